"""An OpenAI-compatible server over a rollout engine (``posttrain serve``; the GenRM server of a run;
the policy's endpoint for agent programs).

- :mod:`posttrain.serve.protocol`: OpenAI's request/response shapes -> :class:`Job`, back to JSON.
- :mod:`posttrain.serve.batcher`: one thread decodes waiting requests together (:class:`Batcher`).
- :mod:`posttrain.serve.app`: the HTTP routes (Starlette), API key, JSON errors, streaming.
- :mod:`posttrain.serve.server`: :class:`CompletionServer` (start/stop in a process) and the command line.

Needs the ``serve`` extra (starlette, uvicorn): ``pip install -e ".[serve]"``.
"""

from posttrain.serve.batcher import Batcher, ServeRecord
from posttrain.serve.protocol import Choice, Job, ServeError

__all__ = ["Batcher", "Choice", "CompletionServer", "Job", "ServeError", "ServeRecord"]


def __getattr__(name):
    if name == "CompletionServer":  # lazy: starlette/uvicorn load only when a server is built
        from posttrain.serve.server import CompletionServer

        return CompletionServer
    raise AttributeError(f"module 'posttrain.serve' has no attribute {name!r}")
