"""verl's code-interpreter tool (posttrain.tools.sandbox_fusion_tools): the code runs in the local
sandbox or on a SandboxFusion server (here a tiny stdlib HTTP server in the test speaking SandboxFusion's
JSON and counting the calls in flight); verl's loader; a bad tool YAML is one ConfigError at start-up."""

import asyncio
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.tools.calculator_tool import CalculatorTool
from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool
from posttrain.tools.utils import sandbox_fusion_client
from posttrain.tools.utils.tool_registry import initialize_tools_from_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_config" / "sandbox_fusion_tool_config.yaml"


# ---------------------------------------------------------------- a SandboxFusion-compatible test server
class FakeSandboxFusion:
    """POST /run_code runs the code with ``python -c`` (run_timeout honoured) after ``delay_s``; records
    the requests and the most calls it had in flight at once."""

    def __init__(self, delay_s=0.0):
        self.delay_s, self.requests, self.in_flight, self.most_in_flight = delay_s, [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body = json.dumps(server.answer(self.path, request)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/run_code"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path, request):
        with self.lock:
            self.requests.append((path, request))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            return _run(request)
        finally:
            with self.lock:
                self.in_flight -= 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _run(request):
    try:
        done = subprocess.run([sys.executable, "-I", "-c", request["code"]], capture_output=True, text=True,
                              timeout=request["run_timeout"])
    except subprocess.TimeoutExpired:
        return {"status": "Failed", "message": "", "compile_result": None,
                "run_result": {"status": "TimeLimitExceeded", "execution_time": request["run_timeout"],
                               "return_code": None, "stdout": "", "stderr": ""}}
    return {"status": "Success" if done.returncode == 0 else "Failed", "message": "", "compile_result": None,
            "run_result": {"status": "Finished", "execution_time": 0.01, "return_code": done.returncode,
                           "stdout": done.stdout, "stderr": done.stderr}}


@pytest.fixture
def server():
    fake = FakeSandboxFusion()
    yield fake
    fake.close()


@pytest.fixture(autouse=True)
def fresh_global_limit(monkeypatch):
    """Each test gets its own process-wide in-flight limit (the first tool to ask sets its size)."""
    monkeypatch.setattr(sandbox_fusion_client, "_SHARED", {})


def _call(tool, code):
    async def go():
        instance, _ = await tool.create()
        try:
            return await tool.execute(instance, {"code": code})
        finally:
            await tool.release(instance)

    return asyncio.run(go())


def _calls(tool, codes):
    async def go():
        return await asyncio.gather(*(tool.execute("i", {"code": c}) for c in codes))

    return asyncio.run(go())


# ---------------------------------------------------------------- over HTTP
def test_over_http_prints_and_posts_sandbox_fusion_json(server):
    tool = SandboxFusionTool({"sandbox_fusion_url": server.url, "default_timeout": 7, "memory_limit_mb": 512})
    response, reward, metrics = _call(tool, "print(6*7)")
    assert response.text.strip() == "42" and reward == 0.0 and metrics == {}
    path, request = server.requests[0]
    assert path == "/run_code"
    assert request == {"code": "print(6*7)", "language": "python", "run_timeout": 7, "memory_limit_MB": 512,
                       "stdin": ""}
    assert tool.name == "code_interpreter" and tool.tool_schema.function.parameters["required"] == ["code"]


def test_over_http_errors_and_time_outs_are_tool_errors(server):
    tool = SandboxFusionTool({"sandbox_fusion_url": server.url.removesuffix("/run_code"), "default_timeout": 0.5})
    assert tool.sandbox_fusion_url == server.url  # a URL without a path gets /run_code
    response, _, metrics = _call(tool, "print('partial'); 1/0")
    assert response.text.startswith("partial\n") and "ZeroDivisionError" in response.text
    assert metrics == {"tool_error": 1.0}
    response, _, metrics = _call(tool, "import time; time.sleep(5)")
    assert "time limit of 0.5 s" in response.text
    assert metrics == {"tool_error": 1.0, "sandbox_kill": "timeout", "tool_timeout": 1.0}


def test_a_server_that_is_down_is_an_error_message_not_a_crash(monkeypatch):
    monkeypatch.setattr(sandbox_fusion_client, "RETRY_PAUSE_S", 0.0)
    fake = FakeSandboxFusion()
    url = fake.url
    fake.close()  # nothing listens there now
    response, _, metrics = _call(SandboxFusionTool({"sandbox_fusion_url": url}), "print(1)")
    assert response.text.startswith(f"Error: the sandbox server at {url} failed") and metrics == {"tool_error": 1.0}


# ---------------------------------------------------------------- concurrency limits (measured by the server)
@pytest.mark.parametrize("workers, most", [(2, 2), (6, 6)])
def test_num_workers_bounds_the_calls_in_flight(workers, most):
    fake = FakeSandboxFusion(delay_s=0.3)
    try:
        tool = SandboxFusionTool({"sandbox_fusion_url": fake.url, "num_workers": workers, "rate_limit": 100})
        results = _calls(tool, ["print(1)"] * 6)
        assert all(r[0].text.strip() == "1" for r in results)
        assert fake.most_in_flight == most  # 6 workers: all six at once (the negative control)
    finally:
        fake.close()


@pytest.mark.parametrize("shared, most", [(True, 2), (False, 4)])
def test_the_global_rate_limit_is_shared_by_the_tools_of_the_process(shared, most):
    fake = FakeSandboxFusion(delay_s=0.3)
    try:
        config = {"sandbox_fusion_url": fake.url, "num_workers": 4, "rate_limit": 2, "enable_global_rate_limit": shared}
        tools = [SandboxFusionTool(config), SandboxFusionTool(config)]

        async def go():
            return await asyncio.gather(*(t.execute("i", {"code": "print(1)"}) for t in tools for _ in range(4)))

        assert len(asyncio.run(go())) == 8
        assert fake.most_in_flight == most  # per tool (not shared): 2 + 2
    finally:
        fake.close()


# ---------------------------------------------------------------- the local sandbox
def test_without_a_url_the_code_runs_in_the_local_sandbox():
    tool = SandboxFusionTool({"default_timeout": 5})  # isolation auto: the best this machine has
    assert tool.sandbox is not None and tool.sandbox_fusion_url == ""
    response, _, metrics = _call(tool, "print(6*7)")
    assert response.text.strip() == "42" and metrics == {}
    response, _, metrics = _call(tool, "raise SystemExit(3)")
    assert metrics.get("tool_error") == 1.0


def test_verl_retool_worker_counts_run_locally():
    """verl's retool YAML asks for 128 workers and a rate limit of 128; the local sandbox runs at most its
    process's run slots at once, the rest wait."""
    tool = SandboxFusionTool({"num_workers": 128, "rate_limit": 128, "default_timeout": 5})
    assert tool.num_workers == 128 and 1 <= tool.sandbox.num_workers <= 128
    assert all(r[0].text.strip() == "3" for r in _calls(tool, ["print(1 + 2)"] * 4))


def test_the_local_sandbox_time_out_is_a_kill_by_cause():
    tool = SandboxFusionTool({"default_timeout": 0.5})
    start = time.monotonic()
    response, _, metrics = _call(tool, "while True: pass")
    assert time.monotonic() - start < 5
    assert metrics["sandbox_kill"] in ("timeout", "cpu") and metrics["tool_error"] == 1.0


# ---------------------------------------------------------------- verl's loader and the YAML checks
def test_verl_loader_returns_the_tool_instances(tmp_path):
    tools = initialize_tools_from_config(str(EXAMPLE))
    assert [type(t) for t in tools] == [SandboxFusionTool] and tools[0].num_workers == 4
    assert tools[0].sandbox is not None  # no URL: the local sandbox
    path = tmp_path / "tools.yaml"
    path.write_text(EXAMPLE.read_text().replace("      type: native", "      type: native\n"
                                                "      sandbox_fusion_url: http://localhost:8080/run_code")
                    + "  - class_name: posttrain.tools.calculator_tool.CalculatorTool\n    config: {type: native}\n")
    tools = initialize_tools_from_config(str(path))
    assert [type(t) for t in tools] == [SandboxFusionTool, CalculatorTool]
    assert [t.name for t in tools] == ["code_interpreter", "calculator"]
    assert tools[0].sandbox_fusion_url == "http://localhost:8080/run_code" and tools[0].default_timeout == 10


URL = "http://localhost:8080/run_code"
BAD_CONFIGS = [  # (key, value, what the message quotes, the rule it states)
    ("sandbox_fusion_url", "localhost:8080", "sandbox_fusion_url='localhost:8080'", "http(s)://host[:port]"),
    ("sandbox_fusion_url", "ftp://host/run_code", "sandbox_fusion_url=", "http(s)://host[:port]"),
    ("sandbox_fusion_url", "http://:8080/run_code", "sandbox_fusion_url=", "http(s)://host[:port]"),
    ("sandbox_fusion_url", "http://host:99999/run_code", "sandbox_fusion_url=", "http(s)://host[:port]"),
    ("sandbox_fusion_url", "http://host:port/run_code", "sandbox_fusion_url=", "http(s)://host[:port]"),
    ("default_language", "cobol", "default_language='cobol'", "expected one of python, cpp"),
    ("default_timeout", 0, "default_timeout=0", "a number > 0 and <= 3600"),
    ("default_timeout", -5, "default_timeout=-5", "a number > 0 and <= 3600"),
    ("default_timeout", 1000000, "default_timeout=1000000", "a number > 0 and <= 3600"),
    ("default_timeout", "thirty", "default_timeout='thirty'", "a number > 0"),
    ("memory_limit_mb", 8, "memory_limit_mb=8", "an integer >= 64 and <= 65536"),
    ("memory_limit_mb", 10000000, "memory_limit_mb=10000000", "an integer >= 64 and <= 65536"),
    ("num_workers", 0, "num_workers=0", "an integer >= 1"),
    ("rate_limit", 0, "rate_limit=0", "an integer >= 1"),
    ("rate_limit", -1, "rate_limit=-1", "an integer >= 1"),
    ("enable_global_rate_limit", "yes", "enable_global_rate_limit='yes'", "true or false"),
    ("sandbox_fusion_urll", URL, "unknown key(s) ['sandbox_fusion_urll']", "valid keys: type, sandbox_fusion_url"),
    ("isolation", "none", "isolation: applies to the local sandbox only", "remove one of the two keys"),
]


@pytest.mark.parametrize("key, value, key_text, rule", BAD_CONFIGS, ids=[f"{c[0]}={c[1]}" for c in BAD_CONFIGS])
def test_a_bad_tool_yaml_is_one_config_error_naming_file_tool_and_key(tmp_path, key, value, key_text, rule):
    config = {"type": "native", "sandbox_fusion_url": URL, key: value}
    path = tmp_path / "bad_tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "posttrain.tools.sandbox_fusion_tools.SandboxFusionTool",
                                           "config": config}]}))  # JSON is YAML
    with pytest.raises(ConfigError) as err:
        initialize_tools_from_config(str(path))
    message = str(err.value)
    assert message.startswith(f"{path} tools[0]: tool 'code_interpreter': config")
    assert key_text in message and rule in message and "\n" not in message


def test_an_unknown_isolation_level_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"config.isolation='walls': expected one of auto, namespaces, bwrap, none"):
        SandboxFusionTool({"isolation": "walls"})


def test_over_http_to_posttrain_sandbox_serve():
    """verl's YAML with a URL, served by posttrain's own SandboxFusion-compatible server (in this process)."""
    from posttrain.sandbox import Limits, LocalSandbox
    from posttrain.sandbox.server import make_handler

    sandbox = LocalSandbox(Limits(timeout_s=5), num_workers=2)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(sandbox))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        tool = SandboxFusionTool({"sandbox_fusion_url": f"http://127.0.0.1:{httpd.server_address[1]}/run_code",
                                  "default_timeout": 1})
        response, _, metrics = _call(tool, "print(6*7)")
        assert response.text.strip() == "42" and metrics == {}
        response, _, metrics = _call(tool, "while True: pass")
        assert metrics["sandbox_kill"] in ("timeout", "cpu") and metrics["tool_error"] == 1.0
    finally:
        httpd.shutdown()
        httpd.server_close()
        sandbox.close()


def test_isolation_the_machine_cannot_give_refuses_to_start():
    from posttrain.sandbox import isolation_available

    if isolation_available().get("bwrap") is None:
        pytest.skip("bubblewrap is available here")
    with pytest.raises(ConfigError, match=r"config.isolation='bwrap': .*isolation: none"):
        SandboxFusionTool({"isolation": "bwrap"})


def test_a_second_global_rate_limit_of_another_size_is_shared_and_warned_about(caplog):
    url = {"sandbox_fusion_url": "http://localhost:8080/run_code"}
    first, second = SandboxFusionTool({**url, "rate_limit": 3}), SandboxFusionTool({**url, "rate_limit": 5})
    assert first._in_flight is second._in_flight
    assert "rate_limit=5: the process-wide limit (enable_global_rate_limit) already holds 3 calls" in caplog.text
