"""The HTTP side of ``posttrain serve``: a Starlette app with OpenAI's routes over a :class:`Batcher`.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /health`` (no key needed: liveness, the batcher's counters).
Every refusal is OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) with a
4xx/5xx status: a bad or missing API key (401), an unknown model name (404), a field the server does
not support or a malformed one (400), a prompt longer than the context (400), a full queue (503), an
engine failure (500). ``stream=true`` answers with server-sent events (``data: {...}`` lines, then
``data: [DONE]``); the text comes in one chunk when the sequence is done.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, Callable, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from posttrain.serve.batcher import Batcher
from posttrain.serve.protocol import (Choice, Job, ServeError, chat_response, chat_stream_events, completion_response,
                                      completion_stream_events, error_body, parse_chat, parse_completion)

__all__ = ["build_app", "KeyCheck", "RequestHook"]

KeyCheck = Callable[[str], bool]
"""An API-key check: ``check(presented_key) -> bool`` (per-episode keys, for instance)."""


class RequestHook(Protocol):
    """What a server that knows its clients (the agent episodes of a run: `posttrain.agents.sessions`)
    does around each request, by the API key it presented."""

    def parse(self, kind: str, body: Any, tokenizer: Any, key: str | None) -> Job:
        """The request as a :class:`Job` (``kind``: chat or completion); ``max_tokens`` 0 answers at once
        with an empty ``length`` choice (nothing left to sample)."""

    def refused(self, key: str | None, error: ServeError) -> None:
        """A request of ``key`` was refused with ``error`` (counted)."""

MAX_BODY_BYTES = 32 << 20


def _error(err: ServeError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def _presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key")


def _authorized(presented: str | None, api_key: str | KeyCheck | None) -> bool:
    if api_key is None:
        return True
    if presented is None:
        return False
    if callable(api_key):
        return bool(api_key(presented))
    return hmac.compare_digest(presented.encode(), api_key.encode())


def build_app(batcher: Batcher, model_name: str, *, api_key: str | KeyCheck | None = None,
              aliases: tuple[str, ...] = (), hook: RequestHook | None = None) -> Starlette:
    """The ASGI app: ``model_name`` (plus ``aliases``) is the one model served; ``api_key`` (a string, or a
    :data:`KeyCheck`) is required on ``/v1/*`` when given; ``hook`` parses requests in its place."""
    names = (model_name, *aliases)
    created = int(time.time())

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "posttrain",
                "max_model_len": batcher.max_model_len}

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            key = _presented_key(request)
            if not _authorized(key, api_key):
                return _error(ServeError("a valid API key is required (Authorization: Bearer <key>)", status=401,
                                         code="invalid_api_key"))
            try:
                return await handler(request, key)
            except ServeError as err:
                if hook is not None:
                    hook.refused(key, err)
                return _error(err)
        return endpoint

    async def list_models(request: Request, key: str | None) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in names]})

    async def get_model(request: Request, key: str | None) -> Response:
        name = request.path_params["model"]
        if name not in names:
            raise ServeError(f"model {name!r} is not served here; served: {list(names)}", status=404,
                             code="model_not_found")
        return JSONResponse(model_card(name))

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ServeError(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ServeError(f"the request body is not JSON: {err}") from None

    def make_generate(kind, parse, respond, events):
        async def generate(request: Request, key: str | None) -> Response:
            body = await read_json(request)
            if isinstance(body, dict) and body.get("model") not in names:
                raise ServeError(f"model {body.get('model')!r} is not served here; served: {list(names)}",
                                 status=404, param="model", code="model_not_found")
            with batcher.tokenizer_lock:
                job = parse(body, batcher.tokenizer) if hook is None else hook.parse(kind, body, batcher.tokenizer, key)
            if job.max_tokens == 0:  # the hook leaves nothing to sample (an episode's token budget is spent)
                choices = [[Choice([], [], "", "length") for _ in range(job.n)] for _ in job.prompts]
            else:
                choices = await asyncio.wrap_future(batcher.submit(job, key))
            with batcher.tokenizer_lock:
                if not job.stream:
                    return JSONResponse(respond(job, choices, batcher.tokenizer))
                chunks = events(job, choices, batcher.tokenizer)

            async def stream():
                for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")
        return generate

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, **batcher.stats})

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(ServeError(f"no route {request.method} {request.url.path}; routes: GET /v1/models, "
                                 "POST /v1/chat/completions, POST /v1/completions, GET /health", status=404,
                                 code="not_found"))

    async def bad_method(request: Request, exc: Exception) -> Response:
        return _error(ServeError(f"{request.method} is not allowed on {request.url.path}", status=405))

    routes = [
        Route("/v1/models", guarded(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(get_model), methods=["GET"]),
        Route("/v1/chat/completions", guarded(make_generate("chat", parse_chat, chat_response, chat_stream_events)),
              methods=["POST"]),
        Route("/v1/completions", guarded(make_generate("completion", parse_completion,
                                                       completion_response, completion_stream_events)), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
