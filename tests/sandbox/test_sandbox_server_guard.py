"""Issue 59: `posttrain sandbox serve` runs code only for its owner. Each refusal has its control: the same
request with the token (and nothing else changed) runs the code."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
from sandbox_checks import TOKEN, server_env, serving

RUN = json.dumps({"code": "print(6 * 7)", "language": "python"}).encode()


@pytest.fixture(scope="module")
def server():
    with serving("--timeout-s", "5", "--num-workers", "2", "--read-timeout-s", "1") as url:
        yield urllib.parse.urlsplit(url)


def raw(url, request: bytes, timeout_s: float = 20.0) -> tuple[int, dict]:
    """Send ``request`` bytes as they are; (HTTP status, JSON body) of the answer."""
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as connection:
        connection.sendall(request)
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
            if length and len(body) >= length[0]:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request(body: bytes = RUN, *, token: str | None = TOKEN, content_type: str | None = "application/json",
            length: str | None = None, extra: str = "") -> bytes:
    lines = ["POST /run_code HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body) if length is None else length}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_the_token_is_required_and_compared_whole(server):
    assert raw(server, request(token=None))[0] == 401
    assert raw(server, request(token=TOKEN[:-1]))[0] == 401
    assert raw(server, request(token=TOKEN + "x"))[0] == 401
    status, answer = raw(server, request())  # control: the same request with the token runs
    assert status == 200 and answer["run_result"]["stdout"] == "42\n"


def test_a_web_page_cannot_run_code(server):
    """A text/plain POST needs no CORS preflight; a page's request carries Origin: both refused."""
    status, answer = raw(server, request(extra="Origin: http://evil.example"))
    assert status == 403 and "Origin" in answer["message"]
    status, answer = raw(server, request(content_type="text/plain"))
    assert status == 415 and answer["status"] == "SandboxError"
    assert raw(server, request(content_type=None))[0] == 415


def test_malformed_requests_get_a_json_error_quickly(server):
    start = time.monotonic()
    status, answer = raw(server, request(b"[" * 100_000 + b"]" * 100_000))  # 100,000 deep
    assert status == 200 and "nested too deeply" in answer["message"]
    status, answer = raw(server, request(length="-1"))
    assert status == 400 and "Content-Length" in answer["message"]
    assert raw(server, request(length="abc"))[0] == 400
    assert raw(server, request(b"{}", length=str(17 << 20)))[0] == 413
    assert time.monotonic() - start < 10
    start = time.monotonic()
    status, answer = raw(server, request(RUN[:10], length=str(len(RUN))))  # promises more than it sends
    assert status == 408 and time.monotonic() - start < 5  # --read-timeout-s 1, not held until the client leaves


def test_200_requests_at_once_are_all_answered(server):
    def health(_):
        return raw(server, b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n",
                   timeout_s=60)[0]

    with ThreadPoolExecutor(200) as pool:
        statuses = list(pool.map(health, range(200)))
    assert statuses == [200] * 200  # none reset (the listen backlog was 5)


def start_serve(*options: str, env: dict | None = None) -> subprocess.CompletedProcess | subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "posttrain.cli", "sandbox", "serve", "--port", "0", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or server_env())


def test_serving_beyond_localhost_needs_a_flag_and_warns():
    refused = subprocess.run([sys.executable, "-m", "posttrain.cli", "sandbox", "serve", "--port", "0", "--host",
                              "0.0.0.0"], capture_output=True, text=True, env=server_env(), timeout=60)
    assert refused.returncode != 0 and "--allow-remote" in refused.stderr and "serving" not in refused.stdout
    allowed = start_serve("--host", "0.0.0.0", "--allow-remote")  # control: with the flag it serves, warning
    assert "serving POST http://0.0.0.0:" in allowed.stdout.readline()
    allowed.stdout.readline()
    allowed.terminate()
    _, err = allowed.communicate(timeout=30)
    assert "WARNING: serving on 0.0.0.0" in err and allowed.returncode == 143


def test_network_says_what_it_opens():
    process = start_serve("--network")
    assert "network open: every port of this machine's localhost" in process.stdout.readline()
    assert "token" in process.stdout.readline()  # the warning follows this line
    process.terminate()
    _, err = process.communicate(timeout=30)
    assert "--network: the code reaches the network and every port of this machine's localhost" in err


def test_a_generated_token_is_printed_and_a_token_file_is_made_private_or_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_SANDBOX_TOKEN"}
    process = start_serve(env=env)
    process.stdout.readline()
    token_line = process.stdout.readline()
    process.terminate()
    process.communicate(timeout=30)
    assert "token new: " in token_line and len(token_line.split("token new: ")[1].split(";")[0]) >= 40
    made = tmp_path / "token"
    process = start_serve("--token-file", str(made), env=env)
    assert "token new, written to" in process.stdout.readline() + process.stdout.readline()
    process.terminate()
    process.communicate(timeout=30)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and len(made.read_text().strip()) >= 40
    made.chmod(0o644)
    refused = subprocess.run([sys.executable, "-m", "posttrain.cli", "sandbox", "serve", "--port", "0",
                              "--token-file", str(made)], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode != 0 and "others may read it; chmod 600" in refused.stderr


def test_the_start_up_lines_name_every_limit_a_run_gets():
    """Issue 59: the start-up lines did not say the memory or process limits a run would get."""
    import re

    process = start_serve("--timeout-s", "7", "--memory-mb", "512", "--max-processes", "9", "--max-file-mb", "5")
    try:
        lines = [process.stdout.readline() for _ in range(3)]
    finally:
        process.terminate()
        process.communicate(timeout=30)
    limits = lines[2]
    assert limits.startswith("posttrain sandbox: limits of each run"), lines
    assert "wall-clock time-out 7 s, CPU 8 s, memory 512 MB " in limits and "5 MB per file" in limits, limits
    processes = int(re.search(r"(\d+) processes and threads", limits).group(1))
    assert 1 <= processes <= 9  # 9, or fewer where no memory cgroup bounds the whole run (the line says per process)
    assert "network off" in limits
