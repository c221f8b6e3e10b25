"""OpenMP threads that sleep while they wait, chosen by the command line before torch starts.

torch's CPU kernels run on an OpenMP pool; by default (libgomp) a thread that reaches a barrier
first spins for a while before sleeping. On a machine whose cores are shared with other processes
a spinning thread burns the core its descheduled peer needs, and every one of the thousands of
small ops in a decoding step pays for it. Measured on 2 cores (`benchmarks/bench_threads.py`,
SmolLM2-shaped model, bf16: 16 decode steps x 32 rows + one forward/backward): beside one busy
process the default took 2.65x its quiet time, ``OMP_WAIT_POLICY=PASSIVE`` 1.07-1.44x, for
10% more time on a quiet machine. So `posttrain` sets PASSIVE unless the user set a policy.
"""

from __future__ import annotations

import os

__all__ = ["prefer_sleeping_threads"]


def prefer_sleeping_threads() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless set (read once, when the OpenMP runtime starts: call this
    before anything imports torch). Ray ranks started by this process inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
