"""verl's own code, imported from an unpacked wheel named by ``POSTTRAIN_VERL_SRC`` (e.g. ``/tmp/verl091``), for
tests that compare our functions with verl's where it is at hand; without it those tests are skipped (CI has
no verl: the transcribed references in ``tests/algorithms/verl_*_ref.py`` run there instead).

verl imports packages its loss functions never call (``codetiming``, ``datasets``); where they are missing
they are stood in for by empty modules, found after the real ones (a real one always wins).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

import pytest

STAND_INS = ("codetiming", "datasets")


class _Anything:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def verl_module(name: str):
    """``import name`` from ``$POSTTRAIN_VERL_SRC`` (skips the test when unset or when verl does not import)."""
    root = os.environ.get("POSTTRAIN_VERL_SRC")
    if not root:
        pytest.skip("POSTTRAIN_VERL_SRC (an unpacked verl wheel) is not set")
    if root not in sys.path:
        sys.path.append(root)
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.append(_StandIns())  # after the real finders: only what is missing is stood in for
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - any import failure of a foreign tree is a skip, said
        pytest.skip(f"verl from {root} does not import here: {err!r}")
