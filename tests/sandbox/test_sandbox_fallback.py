"""The paths this root machine does not take on its own, simulated: the namespace probe failing (as where
unprivileged user namespaces are off), and the non-root path (``unshare --map-root-user``). Each check runs
code to show the one line the sandbox prints about its isolation is true."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid
from pathlib import Path
from unittest import mock

import pytest
from sandbox_checks import Leftovers, needs_namespaces

import posttrain.sandbox.local as local
from posttrain.errors import ConfigError
from posttrain.sandbox import Limits, LocalSandbox

UNPRIVILEGED_UNSHARE = "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"


@pytest.fixture
def fresh_probe():
    """The probe's cached answer forgotten before and after (it is per process)."""
    local.isolation_available.cache_clear()
    local._announce.cache_clear()
    yield
    local.isolation_available.cache_clear()
    local._announce.cache_clear()


@pytest.fixture
def failing_unshare(tmp_path, monkeypatch):
    """An `unshare` first on PATH that fails as util-linux's does where user namespaces are not allowed."""
    fake = tmp_path / "bin" / "unshare"
    fake.parent.mkdir()
    fake.write_text(UNPRIVILEGED_UNSHARE)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield server.getsockname()[1]
    server.close()


def connect_code(port: int) -> str:
    return f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\nprint('connected')"


def test_a_failing_probe_refuses_to_start_in_one_line_naming_the_weaker_key(fresh_probe, failing_unshare):
    assert "Operation not permitted" in local.isolation_available()["namespaces"]
    for asked in ("auto", "namespaces"):
        with pytest.raises(ConfigError) as error:
            LocalSandbox(Limits(isolation=asked))
        message = str(error.value)
        assert "\n" not in message and "Operation not permitted" in message
        assert "isolation: none" in message and "--isolation none" in message


def test_the_non_root_hint_names_user_namespaces(fresh_probe, failing_unshare):
    with mock.patch.object(local, "_is_root", return_value=False):
        assert "unprivileged user namespaces" in local.isolation_available()["namespaces"]
    local.isolation_available.cache_clear()
    assert "unprivileged user namespaces" not in local.isolation_available()["namespaces"]  # root: no such hint


def test_isolation_none_as_root_with_an_interpreter_others_cannot_reach_is_refused(fresh_probe, failing_unshare):
    """The code would run as root (it read /etc/shadow): refused, naming the folder in the way."""
    if os.geteuid() != 0 or local._reachable_by_others(local._interpreter_paths()):
        pytest.fail("this check needs root and an interpreter in a folder others may not enter (as /root/.pyenv)")
    with pytest.raises(ConfigError, match=r"isolation 'none' as root: the code would run as root.*mode 700"):
        LocalSandbox(Limits(isolation="none"))
    with mock.patch.object(local, "_reachable_by_others", return_value=True):  # control: a reachable interpreter
        assert LocalSandbox(Limits(isolation="none")).uid_for(0) is not None  # a uid of its own


def test_isolation_none_says_what_holds_and_it_does(fresh_probe, failing_unshare, listener, caplog, monkeypatch):
    monkeypatch.setattr(local, "_is_root", lambda: False)  # as a user: isolation none runs as that user
    with caplog.at_level(logging.WARNING, logger="posttrain.sandbox.local"):
        sandbox = LocalSandbox(Limits(isolation="none", timeout_s=1.0, memory_mb=128), num_workers=1)
    line = sandbox.isolation
    assert line.startswith("none (holds: resource limits, memory 128 MB")
    assert "NOT isolated: network, file system" in line
    assert [r.getMessage() for r in caplog.records] == [f"sandbox isolation: {line}"]  # said once, loudly
    with Leftovers():
        memory = sandbox.run("block = bytearray(512 << 20)")
        timeout = sandbox.run("while True:\n    pass")
        network = sandbox.run(connect_code(listener))
    assert memory.status == "memory" and timeout.status == "timeout"  # what the line says holds, holds
    assert network.status == "ok" and network.stdout == "connected\n"  # and what it says is open, is


def test_the_non_root_path_runs_in_a_user_namespace_with_the_same_walls(fresh_probe, listener):
    needs_namespaces()
    target = Path(tempfile.gettempdir(), f"escaped-{uuid.uuid4().hex}.txt")  # /tmp: anyone may write
    code = (f"import os\nprint(os.getuid())\ntry:\n    open({str(target)!r}, 'w').write('x')\n"
            f"except OSError as error:\n    print(type(error).__name__, error.errno)\n" + connect_code(listener))
    with mock.patch.object(local, "_is_root", return_value=False):
        assert local._unshare_command(network=False)[-2:] == ["--map-root-user", "--"]
        sandbox = LocalSandbox(Limits(timeout_s=5.0), num_workers=1)
        line = sandbox.isolation
        assert line.startswith("namespaces (unshare: pid, mount, ipc, net, user; no network;")
        assert "without capabilities, so max_processes counts all your processes" in line
        assert sandbox.uid_for(0) is None  # no uid of its own: RLIMIT_NPROC counts the user's processes
        with Leftovers():
            result = sandbox.run(code)
    lines = result.stdout.splitlines()
    assert lines[0] == "0"  # root inside its user namespace, mapped to the caller's uid outside
    assert lines[1] == "OSError 30" and not target.exists()  # EROFS: read-only outside the folder
    assert result.limit_hit == "no network in the sandbox" and "connected" not in result.stdout
    # control: the same code without namespaces writes the file and connects
    with mock.patch.object(local, "_is_root", return_value=False):
        open_sandbox = LocalSandbox(Limits(timeout_s=5.0, isolation="none", network=True), num_workers=1)
        control = open_sandbox.run(code)
    assert control.stdout.splitlines()[-1] == "connected" and target.read_text() == "x"
    target.unlink()
