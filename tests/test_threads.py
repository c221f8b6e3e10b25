"""The command line asks OpenMP for sleeping waits before torch starts (posttrain/threads.py)."""

import subprocess
import sys

from posttrain.threads import prefer_sleeping_threads


def test_passive_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    prefer_sleeping_threads()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    prefer_sleeping_threads()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_entry_points_set_it_before_torch_loads():
    """The policy is read once, when torch's OpenMP runtime starts: the entry modules must not import
    torch before `prefer_sleeping_threads` runs; the child sees the policy the CLI set."""
    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); "
            "import posttrain.cli, posttrain.trainer.main_ppo; assert 'torch' not in sys.modules; "
            "sys.argv = ['posttrain', 'config', '--keys']; "
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: posttrain.cli.entry()\n"
            "    except SystemExit: pass\n"
            "print(os.environ['OMP_WAIT_POLICY'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE"
