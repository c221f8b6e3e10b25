"""``posttrain serve MODEL``: an OpenAI-compatible server over a rollout engine, on its own or inside a run.

On its own::

    posttrain serve smollm2-135m-instruct --port 8000 --api-key secret
    # then any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")

Inside a process that already holds an engine (the GenRM server of a run, the policy's endpoint for
agent programs), over that engine object and so over its current weights::

    server = CompletionServer(engine, tokenizer, model_name="policy", recorder=records.append).start()
    server.url        # "http://127.0.0.1:<port>/v1"  (an OpenAI client's base_url)
    server.address    # "127.0.0.1:<port>"           (verl's reward_router_address)
    with server.engine_lock: ...                      # change weights between batches
    server.stop()

It binds 127.0.0.1 unless told otherwise (``--host 0.0.0.0`` without ``--api-key`` prints a warning).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from posttrain.cli_args import file_to_read, non_negative_float, port_number, positive_int
from posttrain.errors import ConfigError
from posttrain.serve.app import KeyCheck, RequestHook, build_app
from posttrain.serve.batcher import Batcher, ServeRecord

__all__ = ["CompletionServer", "main", "build_engine"]


def _context_length(model: Any, tokenizer: Any) -> int:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10 ** 7 else 2048


class CompletionServer:
    """The server: a :class:`Batcher` over ``engine`` and the HTTP app, in background threads.

    Args:
        engine: a rollout engine (``posttrain.rollout``): ``generate(Batch, SamplingParams) -> Batch``.
        tokenizer: the model's tokenizer (chat template, decoding).
        model_name: the name clients send as ``model`` (``/v1/models`` lists it).
        host, port: where to listen (port 0: a free port; ``port`` tells which after ``start``).
        api_key: a key every ``/v1`` request must present, or a ``check(key) -> bool``; None: no key.
        max_model_len: context length (default: the model config's ``max_position_embeddings``).
        recorder: receives a :class:`ServeRecord` per finished request (prompt ids, sampled ids, log-probs).
        hook: parses each request in the server's place and hears of its refusals (`posttrain.serve.app.RequestHook`:
            the agent episodes of a run, `posttrain.agents.sessions`).
        Other keyword arguments go to :class:`Batcher` (``max_batch_rows``, ``default_max_tokens``,
        ``batch_wait_s``, ``max_pending_rows``, ``admit``).
    """

    def __init__(self, engine: Any, tokenizer: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | KeyCheck | None = None, max_model_len: int | None = None,
                 recorder: Callable[[ServeRecord], None] | None = None, aliases: tuple[str, ...] = (),
                 hook: RequestHook | None = None, **batcher_kwargs: Any):
        length = max_model_len or _context_length(getattr(engine, "model", None), tokenizer)
        self.batcher = Batcher(engine, tokenizer, max_model_len=length, recorder=recorder, **batcher_kwargs)
        self.app = build_app(self.batcher, model_name, api_key=api_key, aliases=aliases, hook=hook)
        self.model_name, self.host, self.port = model_name, host, int(port)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def engine_lock(self) -> threading.Lock:
        return self.batcher.engine_lock

    @property
    def address(self) -> str:
        """``host:port``, the form verl passes as ``reward_router_address``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI clients' ``base_url``."""
        return f"http://{self.address}/v1"

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without it a keep-alive client's request waits ~40 ms per call
        # (Nagle's algorithm against the peer's delayed ACK: 52 ms -> 4 ms a chat call, measured)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(2048)  # connections made from here on wait for the server instead of being refused
        except OSError as err:
            sock.close()
            raise ConfigError(f"posttrain serve cannot listen on {self.host}:{self.port}: {err.strerror or err}") from None
        self.port = sock.getsockname()[1]
        return sock

    def _uvicorn(self):
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        return uvicorn.Server(config)

    def start(self, timeout: float = 30.0) -> "CompletionServer":
        """Listen in a background thread; returns once requests are accepted."""
        sock = self._bind()
        self.batcher.start()
        self._server = self._uvicorn()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="posttrain-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"posttrain serve did not start on {self.address}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting requests, let the batch now decoding finish, fail those still waiting."""
        if self._server is not None:
            self._server.should_exit = True
        self.batcher.stop()
        if self._thread is not None:
            self._thread.join(15)
        self._server, self._thread = None, None

    def serve_forever(self, announce: Callable[[str], None] | None = None) -> None:
        """Listen in this thread until SIGINT/SIGTERM (the command line); ``announce(url)`` once bound."""
        sock = self._bind()
        if announce is not None:
            announce(self.url)
        self.batcher.start()
        self._server = self._uvicorn()
        try:
            self._server.run(sockets=[sock])
        finally:
            self.batcher.stop()

    def __enter__(self) -> "CompletionServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def build_engine(name: str, model_path: str, *, dtype: str = "fp32", device: str = "cpu",
                 trust_remote_code: bool = False, chat_template: str | None = None, max_model_len: int | None = None):
    """``(engine, tokenizer, model)`` for ``model_path`` (a folder, hub id, ``.gguf`` or ``smollm2-135m-instruct``)."""
    from posttrain.checkpoint.found import checkpoint_found
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.rollout import get_rollout_engine

    local = Path(model_path).expanduser()
    found = checkpoint_found(local) if local.is_dir() and not (local / "config.json").exists() else None
    if found:  # a checkpoint root: say so, not "no config.json" from the loader
        raise ConfigError(f"posttrain serve {model_path}: {found}")
    try:
        tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code, custom_chat_template=chat_template)
        model = load_causal_lm(model_path, trust_remote_code=trust_remote_code, dtype=dtype, device=device)
    except (OSError, ValueError) as err:  # no such folder or hub id, not a causal LM, a bad dtype
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"posttrain serve {model_path}: cannot load the model: {first}") from None
    model.eval()
    if name == "hf":
        return get_rollout_engine("hf", model=model, tokenizer=tokenizer), tokenizer, model
    if name == "vllm":
        from types import SimpleNamespace

        rollout = SimpleNamespace(dtype={"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype),
                                  max_model_len=max_model_len, free_cache_engine=False, enable_prefix_caching=True,
                                  logprobs_mode="raw_logprobs")
        engine = get_rollout_engine("vllm", model=model, tokenizer=tokenizer, config=rollout, seed=0)
        engine.update_weights(model)
        return engine, tokenizer, model
    raise ConfigError(f"--engine {name!r}: posttrain serve runs the hf or vllm engine")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain serve", description=(
        "Serve a model with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), batching "
        "concurrent requests. Any OpenAI client works: base_url=http://HOST:PORT/v1."))
    p.add_argument("model", help="a model folder, hub id, .gguf file, or smollm2-135m-instruct")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000, help="port (0: a free one, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("POSTTRAIN_SERVE_API_KEY"),
                   help="key clients must send (Authorization: Bearer KEY); default $POSTTRAIN_SERVE_API_KEY, else none")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine (vllm where installed)")
    p.add_argument("--dtype", default="fp32", help="weights dtype: fp32 or bf16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-model-len", type=positive_int, help="context length (default: the model config's)")
    p.add_argument("--default-max-tokens", type=positive_int, default=512, help="max_tokens of a request that gives none")
    p.add_argument("--max-batch-rows", type=positive_int, default=64, help="rows (prompts x n) decoded together at most")
    p.add_argument("--batch-wait-ms", type=non_negative_float, default=0.0,
                   help="how long a batch waits for more requests once the engine is free (default 0)")
    p.add_argument("--chat-template", type=file_to_read("a Jinja chat template file"),
                   help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for package in ("starlette", "uvicorn"):
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"posttrain serve needs {package}: pip install -e \".[serve]\" (starlette, uvicorn, httpx)")
    template = None
    if args.chat_template:
        from posttrain.errors import read_utf8

        template = read_utf8(args.chat_template, ConfigError)
    engine, tokenizer, _ = build_engine(args.engine, args.model, dtype=args.dtype, device=args.device,
                                        trust_remote_code=args.trust_remote_code, chat_template=template,
                                        max_model_len=args.max_model_len)
    name = args.served_model_name or args.model
    server = CompletionServer(engine, tokenizer, model_name=name, host=args.host, port=args.port,
                              api_key=args.api_key or None, max_model_len=args.max_model_len,
                              default_max_tokens=args.default_max_tokens, max_batch_rows=args.max_batch_rows,
                              batch_wait_s=args.batch_wait_ms / 1000.0)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr)
    server.serve_forever(announce=lambda url: print(
        f"posttrain serve: model {name!r} ({args.engine} engine, context {server.batcher.max_model_len} tokens) at "
        f"{url}; Ctrl-C stops", flush=True))
    return 0
