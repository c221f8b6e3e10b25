"""`posttrain sandbox serve`: SandboxFusion's /run_code JSON over HTTP, started as users start it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest
from sandbox_checks import TOKEN, Leftovers, processes_with, server_env, serving

from posttrain.sandbox import Limits, RunResult
from posttrain.sandbox.server import request_limits, response_for


@pytest.fixture(scope="module")
def server():
    """A server on a free port (``--port 0``), its URL read from the line it prints; stopped with SIGTERM."""
    with serving("--timeout-s", "5", "--num-workers", "2", "--isolation", "auto") as url:
        yield url


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_run_code_answers_with_sandbox_fusion_json(server):
    answer = post(server, {"code": "print(6 * 7)", "language": "python", "run_timeout": 5, "memory_limit_MB": 512,
                           "stdin": None, "compile_timeout": 10, "files": {}, "fetch_files": []})
    assert answer["status"] == "Success" and answer["compile_result"] is None
    run = answer["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0 and run["stdout"] == "42\n" and run["stderr"] == ""
    assert isinstance(run["execution_time"], float)


def test_stdin_and_a_failing_program(server):
    answer = post(server, {"code": "import sys\nprint(sys.stdin.read().upper())\nsys.exit(2)", "language": "python",
                           "stdin": "abc"})
    assert answer["status"] == "Failed" and answer["run_result"]["stdout"] == "ABC\n"
    assert answer["run_result"]["return_code"] == 2


def test_time_out_is_time_limit_exceeded_within_the_request_timeout(server):
    marker = f"sandbox-server-{uuid.uuid4().hex}"
    start = time.monotonic()
    answer = post(server, {"code": f"import time\ntime.sleep(60)  # {marker}", "language": "python", "run_timeout": 1})
    assert time.monotonic() - start < 1 + 3.0
    assert answer["status"] == "Failed" and answer["run_result"]["status"] == "TimeLimitExceeded"
    assert answer["posttrain"] == {"status": "timeout", "limit_hit": "wall-clock time-out of 1 s"}


def test_unknown_language_and_bad_body_are_sandbox_errors(server):
    answer = post(server, {"code": "puts 1", "language": "ruby"})
    assert answer["status"] == "SandboxError" and "unknown language 'ruby'" in answer["message"]
    answer = post(server, {"language": "python"})
    assert answer["status"] == "SandboxError" and '"code"' in answer["message"]


def test_requests_cannot_raise_the_servers_limits():
    ceiling = Limits(timeout_s=5, memory_mb=1024)
    assert request_limits({"run_timeout": 100, "memory_limit_MB": 9999}, ceiling) == ceiling
    assert request_limits({"run_timeout": 1, "memory_limit_MB": -1}, ceiling) == ceiling.replace(timeout_s=1.0)


def test_response_for_maps_each_status():
    error = response_for(RunResult("error", "", "boom", 1, 0.1))
    assert error["status"] == "Failed" and error["run_result"]["status"] == "Finished"
    broken = response_for(RunResult("sandbox_error", "", "", None, 0.0, "sandbox error: x"))
    assert broken["status"] == "SandboxError" and broken["run_result"] is None


def test_sigterm_ends_a_run_in_flight_answers_it_and_exits_143():
    process = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "sandbox", "serve", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=server_env())
    answers = []
    with Leftovers(owner_pid=process.pid):
        url = re.search(r"POST (http://\S+/run_code)", process.stdout.readline()).group(1)
        caller = threading.Thread(target=lambda: answers.append(post(url, {"code": "import time\ntime.sleep(60)"})))
        caller.start()
        deadline = time.monotonic() + 20
        while len(processes_with("", process.pid)) < 3 and time.monotonic() < deadline:  # unshare, runner, code
            time.sleep(0.05)
        assert len(processes_with("", process.pid)) == 3, "the run never started"
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 143  # as the README promises (128 + SIGTERM)
        caller.join(timeout=30)
        process.stdout.close()
    assert time.monotonic() - start < 10  # not the 30 s time-out: the run was ended
    assert answers and answers[0]["posttrain"]["status"] == "killed", answers  # the caller got its answer
    assert "its server shut down" in answers[0]["message"]
