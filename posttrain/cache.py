"""posttrain's cache folder: ``~/.cache/posttrain``, or ``POSTTRAIN_CACHE_DIR`` where it is set.

It holds what a later run can reuse instead of measuring or converting again: the precision that
``param_dtype=auto`` measured (``precision.json``) and plain copies of GGUF models (``gguf/``).
Everything in it can be deleted; it is rebuilt on the next run that needs it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get("POSTTRAIN_CACHE_DIR") or Path.home() / ".cache" / "posttrain")
