"""Start-up errors, isolation choice, and concurrency of the local sandbox."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import pytest
from sandbox_checks import needs_namespaces

from posttrain.errors import ConfigError
from posttrain.sandbox import Limits, LocalSandbox, isolation_available


def test_limits_out_of_range_are_one_config_error_naming_each():
    with pytest.raises(ConfigError, match=r"timeout_s=-1 .*memory_mb=0 "):
        Limits(memory_mb=0, timeout_s=-1)
    with pytest.raises(ConfigError, match="isolation='chroot'"):
        Limits(isolation="chroot")


def test_missing_namespaces_refuse_to_start_and_name_the_weaker_key():
    with mock.patch("posttrain.sandbox.local.isolation_available",
                    return_value={"namespaces": "util-linux `unshare` is not installed", "bwrap": "no"}):
        with pytest.raises(ConfigError) as error:
            LocalSandbox(Limits())
        assert "isolation: none" in str(error.value) and "--isolation none" in str(error.value)
        assert "\n" not in str(error.value)
        with mock.patch("posttrain.sandbox.local._is_root", return_value=False):
            assert LocalSandbox(Limits(isolation="none")).isolation.startswith("none")


def test_unimplemented_backend_is_refused():
    with pytest.raises(ConfigError, match="isolation: bwrap is not available"):
        LocalSandbox(Limits(isolation="bwrap"))


def test_isolation_says_what_is_active():
    needs_namespaces()
    assert isolation_available()["namespaces"] is None
    active = LocalSandbox(Limits()).isolation
    assert active.startswith("namespaces") and "no network" in active
    assert "network open" in LocalSandbox(Limits(network=True)).isolation


def test_unknown_language_is_a_sandbox_error_without_running():
    result = LocalSandbox(Limits()).run("puts 1", language="ruby")
    assert result.status == "sandbox_error" and "unknown language 'ruby'" in result.stderr


def test_site_packages_import_and_stdin_reaches_the_code():
    result = LocalSandbox(Limits(timeout_s=20)).run("import sys, numpy\nprint(sys.stdin.read(), numpy.int64(6) * 7)",
                                                    stdin="in")
    assert result.status == "ok" and result.stdout == "in 42\n", result
    assert LocalSandbox(Limits()).run("import posttrain").status == "error"  # .pth hooks do not run


def test_run_async_runs_num_workers_calls_at_once():
    sandbox = LocalSandbox(Limits(timeout_s=20), num_workers=4)

    async def four():
        return await asyncio.gather(*(sandbox.run_async("import time\ntime.sleep(1)\nprint('ok')") for _ in range(4)))

    start = time.monotonic()
    results = asyncio.run(four())
    assert [r.stdout for r in results] == ["ok\n"] * 4, results
    assert time.monotonic() - start < 3.5  # serial would take 4 s of sleeping alone
