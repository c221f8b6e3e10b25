"""Suite-wide settings. Tests build tiny models (64-wide): torch's thread pool gains nothing on
them and, on a busy 2-core machine, its barriers make each small matmul far slower, so every test
runs torch on one thread (tests that measure threading can raise it themselves)."""

import os
import tempfile

import pytest
import torch

# `param_dtype=auto` caches its measurement per machine; tests keep theirs out of ~/.cache
os.environ.setdefault("POSTTRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="posttrain-test-cache-"))


@pytest.fixture(autouse=True)
def _torch_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
