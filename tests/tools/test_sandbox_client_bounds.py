"""Issue 59: the SandboxFusion client sends the server's token and bounds what it reads; no answer, however
large or deep, escapes `SandboxFusionTool.execute` as an exception."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
from sandbox_checks import TOKEN, serving  # noqa: E402

from posttrain.errors import ConfigError  # noqa: E402
from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool  # noqa: E402
from posttrain.tools.utils.sandbox_fusion_client import MAX_ANSWER_BYTES, post_run_code  # noqa: E402

OK = {"status": "Success", "message": "", "run_result": {"status": "Finished", "return_code": 0, "stdout": "ok\n",
                                                         "stderr": ""}}


class Answers(BaseHTTPRequestHandler):
    """Answers by path: /huge (300 MB, streamed), /deep (JSON 100,000 deep), /fine (1 MB of valid JSON)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/huge":
            self._stream(300 << 20)
        elif self.path == "/deep":
            self._body(b"[" * 100_000 + b"]" * 100_000)
        else:
            self._body(json.dumps({**OK, "message": "x" * (1 << 20)}).encode())

    def _body(self, data: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, size: int):
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        chunk = b" " * (1 << 20)
        try:
            for _ in range(size >> 20):
                self.wfile.write(chunk)
        except OSError:
            pass  # the client stopped reading, as it should

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def answers():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def peak_mb(call):
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


def test_a_300_megabyte_answer_is_an_error_read_only_to_the_bound(answers):
    outcome, peak = peak_mb(lambda: post_run_code(f"{answers}/huge", "print(1)", "python", 5, 256))
    assert outcome.error and f"over {MAX_ANSWER_BYTES >> 20} MB" in outcome.text, outcome
    assert peak < 3 * (MAX_ANSWER_BYTES >> 20), peak  # not 300 MB
    fine, _ = peak_mb(lambda: post_run_code(f"{answers}/fine", "print(1)", "python", 5, 256))
    assert not fine.error and fine.text == "ok\n"  # control: an answer under the bound is read


def test_a_deeply_nested_answer_is_an_error_not_an_exception(answers):
    tool = SandboxFusionTool({"sandbox_fusion_url": f"{answers}/deep", "default_timeout": 5})
    response, _, metrics = asyncio.run(tool.execute("i", {"code": "print(1)"}))
    assert metrics["tool_error"] == 1.0 and "RecursionError" in response.text


def test_the_tool_sends_the_token_from_its_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_SANDBOX_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serving("--timeout-s", "5", "--num-workers", "1") as url:
        without = SandboxFusionTool({"sandbox_fusion_url": url, "default_timeout": 5})
        response, _, metrics = asyncio.run(without.execute("i", {"code": "print(6 * 7)"}))
        assert metrics["tool_error"] == 1.0 and "HTTP 401" in response.text and "POSTTRAIN_SANDBOX_TOKEN" in response.text
        with_file = SandboxFusionTool({"sandbox_fusion_url": url, "default_timeout": 5,
                                       "sandbox_token_file": str(token_file)})
        assert asyncio.run(with_file.execute("i", {"code": "print(6 * 7)"}))[0].text == "42\n"
        monkeypatch.setenv("POSTTRAIN_SANDBOX_TOKEN", TOKEN)
        from_env = SandboxFusionTool({"sandbox_fusion_url": url, "default_timeout": 5})
        assert asyncio.run(from_env.execute("i", {"code": "print(6 * 7)"}))[0].text == "42\n"


def test_a_token_file_without_a_url_or_unreadable_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="sandbox_token_file: a server's token; without sandbox_fusion_url"):
        SandboxFusionTool({"sandbox_token_file": str(tmp_path / "token")})
    with pytest.raises(ConfigError, match="sandbox_token_file=.*cannot read it"):
        SandboxFusionTool({"sandbox_fusion_url": "http://127.0.0.1:9/run_code",
                           "sandbox_token_file": str(tmp_path / "missing")})
