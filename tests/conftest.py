"""Suite-wide settings. Tests build tiny models (64-wide): torch's thread pool gains nothing on
them and, on a busy 2-core machine, its barriers make each small matmul far slower, so every test
runs torch on one thread (tests that measure threading can raise it themselves)."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# `param_dtype=auto` caches its measurement per machine; tests keep theirs out of ~/.cache, in a
# folder of this session's that goes when the session ends (a suite run must not leave one per run in /tmp)
if "POSTTRAIN_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="posttrain-test-cache-")
    os.environ["POSTTRAIN_CACHE_DIR"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _torch_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
