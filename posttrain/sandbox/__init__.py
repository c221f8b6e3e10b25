"""posttrain's sandbox for model-written code: `LocalSandbox` (a limited, isolated child process per run)
and `posttrain sandbox serve` (`posttrain.sandbox.server`, SandboxFusion's ``/run_code`` over HTTP).

A ground-floor room: it imports nothing from posttrain but `posttrain.errors`, so tools and reward
functions may use it.
"""

from posttrain.sandbox.limits import Limits, RunResult
from posttrain.sandbox.local import LANGUAGES, LocalSandbox, isolation_available

__all__ = ["LANGUAGES", "Limits", "LocalSandbox", "RunResult", "isolation_available"]
