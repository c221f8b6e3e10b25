"""`posttrain sandbox serve`: SandboxFusion's ``POST /run_code`` over HTTP, backed by `LocalSandbox`.

verl tool YAMLs that name a ``sandbox_fusion_url`` work unchanged, and many rank processes can share one
server. Request (SandboxFusion's ``RunCodeRequest``; ``files``/``fetch_files``/``compile_timeout`` are
accepted and ignored, since only Python runs here):
``{"code": str, "language": "python", "run_timeout": float, "memory_limit_MB": int, "stdin": str|null}``.
Response (``RunCodeResponse``): ``{"status": "Success"|"Failed"|"SandboxError", "message": str,
"compile_result": null, "run_result": {"status": "Finished"|"TimeLimitExceeded"|"Error",
"execution_time": float, "return_code": int|null, "stdout": str, "stderr": str}, "executor_pod_name":
null, "files": {}}`` plus ``"posttrain": {"status": ..., "limit_hit": ...}`` (our `RunResult`'s words).

The server's limits are ceilings: a request's ``run_timeout`` and ``memory_limit_MB`` (-1 or missing: the
server's) are honoured up to them, never above.

Who may call: a request needs ``Authorization: Bearer <token>`` (compared in constant time; the token comes
from ``--token-file``, else ``$POSTTRAIN_SANDBOX_TOKEN``, else is made and printed), carries no ``Origin``
(a web page's request), and sends ``Content-Type: application/json`` with a ``Content-Length`` of at most
16 MB, within 30 s. Anything else is a JSON error with its HTTP status. Another address than localhost
needs ``--allow-remote``. SIGTERM: no new connection, the runs in flight end and are answered, exit 143.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from posttrain.errors import ConfigError
from posttrain.sandbox.limits import ISOLATION_CHOICES, Limits, RunResult
from posttrain.sandbox.local import LANGUAGES, LocalSandbox, limits_words

MAX_REQUEST_BYTES = 16 << 20
READ_TIMEOUT_S = 30.0  # a client that sends less than its Content-Length, or idles, is dropped after this
LISTEN_BACKLOG = 1024  # connections waiting for a thread queue in the kernel instead of being reset
TOKEN_ENV = "POSTTRAIN_SANDBOX_TOKEN"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def client_headers(token: str | None) -> dict:
    """The headers a client of this server sends (`posttrain.tools` uses the same)."""
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}


def response_for(result: RunResult) -> dict:
    """A `RunResult` as SandboxFusion's ``RunCodeResponse``."""
    if result.status == "sandbox_error":
        return {"status": "SandboxError", "message": result.limit_hit or result.stderr, "compile_result": None,
                "run_result": None, "executor_pod_name": None, "files": {},
                "posttrain": {"status": result.status, "limit_hit": result.limit_hit}}
    run_status = "TimeLimitExceeded" if result.status == "timeout" else "Finished"
    return {"status": "Success" if result.status == "ok" and not result.return_code else "Failed",
            "message": result.limit_hit or "", "compile_result": None,
            "run_result": {"status": run_status, "execution_time": result.wall_s, "return_code": result.return_code,
                           "stdout": result.stdout, "stderr": result.stderr},
            "executor_pod_name": None, "files": {},
            "posttrain": {"status": result.status, "limit_hit": result.limit_hit}}


def sandbox_error(message: str) -> dict:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}, "posttrain": {"status": "sandbox_error", "limit_hit": None}}


def request_limits(request: dict, ceiling: Limits) -> Limits:
    """The limits of one request: its run_timeout / memory_limit_MB, capped by the server's."""
    timeout = request.get("run_timeout")
    memory = request.get("memory_limit_MB")
    changes = {}
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        changes["timeout_s"] = max(0.1, min(float(timeout), ceiling.timeout_s))
    if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
        changes["memory_mb"] = max(32, min(memory, ceiling.memory_mb))
    return ceiling.replace(**changes) if changes else ceiling


def answer(body: bytes, sandbox: LocalSandbox) -> dict:
    """The JSON reply to one ``/run_code`` body (never raises for a bad request)."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return sandbox_error(f"the request body is not JSON: {error}")
    except RecursionError:
        return sandbox_error("the request body is JSON nested too deeply to read")
    if not isinstance(request, dict) or not isinstance(request.get("code"), str):
        return sandbox_error('the request needs "code": a string (SandboxFusion\'s /run_code JSON)')
    language = request.get("language", "python")
    if language not in LANGUAGES:
        return sandbox_error(f"unknown language {language!r}; this server runs: {', '.join(LANGUAGES)}")
    stdin = request.get("stdin") or ""
    if not isinstance(stdin, str):
        return sandbox_error('"stdin" must be a string or null')
    return response_for(sandbox.run(request["code"], language, stdin, limits=request_limits(request, sandbox.limits)))


class _Refused(Exception):
    """A request answered with an HTTP error status and a JSON body, before any code runs."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _InFlight:
    """Requests being answered, so a stopping server can wait until each has its answer."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def __enter__(self) -> None:
        with self.changed:
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.count -= 1
            self.changed.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count == 0, timeout=timeout_s)


def make_handler(sandbox: LocalSandbox, token: str | None = None, in_flight: _InFlight | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S) -> type[BaseHTTPRequestHandler]:
    """The request handler: every request needs ``Authorization: Bearer <token>`` (None: no token asked,
    for in-process benchmarks), no ``Origin`` (a web page's request), and POSTs a JSON body."""
    in_flight = in_flight or _InFlight()
    expected = f"Bearer {token}".encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = read_timeout_s  # applied to the socket: no read or keep-alive wait holds a thread longer

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            with in_flight:
                try:
                    self._check_caller()
                    if self.path.rstrip("/") != "/run_code":
                        raise _Refused(404, f"no route {self.path}; POST /run_code")
                    body = self._read_body()
                except _Refused as refused:
                    self._send(refused.status, sandbox_error(str(refused)), close=True)
                    return
                self._send(200, answer(body, sandbox))

        def do_GET(self) -> None:  # noqa: N802
            try:
                self._check_caller()
            except _Refused as refused:
                self._send(refused.status, sandbox_error(str(refused)), close=True)
                return
            self._send(200, {"status": "ok", "isolation": sandbox.isolation, "languages": list(LANGUAGES)})

        def _check_caller(self) -> None:
            if self.headers.get("Origin") is not None:  # a browser's page: no web page may run code here
                raise _Refused(403, "requests from web pages (an Origin header) are refused")
            if expected is not None:
                given = (self.headers.get("Authorization") or "").encode("utf-8", errors="replace")
                if not hmac.compare_digest(given, expected):
                    raise _Refused(401, f"this server needs its token: send 'Authorization: Bearer <token>' (the "
                                        f"posttrain tool sends ${TOKEN_ENV} or its sandbox_token_file)")

        def _read_body(self) -> bytes:
            kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise _Refused(415, f"the body must be JSON sent as Content-Type: application/json (got {kind!r})")
            if self.headers.get("Transfer-Encoding"):
                raise _Refused(411, "send the body with a Content-Length, not chunked")
            text = self.headers.get("Content-Length") or ""
            if not text.isdigit():
                raise _Refused(411 if not text else 400, f"Content-Length must be a whole number of bytes, "
                                                         f"got {text!r}")
            length = int(text)
            if length > MAX_REQUEST_BYTES:
                raise _Refused(413, f"request over {MAX_REQUEST_BYTES} bytes")
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                raise _Refused(408, f"the body did not arrive within {read_timeout_s:g} s") from None
            if len(body) < length:
                raise _Refused(400, f"the body ended after {len(body)} of its {length} bytes")
            return body

        def _send(self, code: int, payload: dict, close: bool = False) -> None:
            data = json.dumps(payload).encode("utf-8")
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close:  # the rest of a refused request's body is never read: the connection cannot go on
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                self.close_connection = True  # the client left before its answer

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
            pass  # one line per call would drown a training log; errors come back in the JSON

    return Handler


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; more wait in the listen backlog."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address, handler, max_connections: int):
        self._connections = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        self._connections.acquire()  # blocks accepting: the kernel queues the next connections meanwhile
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()


def build_parser() -> argparse.ArgumentParser:
    # cli_args is a leaf of argument types (stdlib only): the one import here from outside errors, for the
    # command line alone, so every numeric flag refuses nonsense the way the other commands' flags do
    from posttrain.cli_args import file_to_write, non_negative_int, positive_float, positive_int

    defaults = Limits()
    parser = argparse.ArgumentParser(prog="posttrain sandbox", description="posttrain's sandbox for model code.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="serve")
    serve_parser = actions.add_parser("serve", help="serve SandboxFusion's POST /run_code with the local sandbox",
                                      description="Serve SandboxFusion's POST /run_code with posttrain's local "
                                                  "sandbox; the limits are ceilings of each request's.")
    serve_parser.add_argument("--host", default="127.0.0.1",
                              help="address to bind (default: localhost only; another needs --allow-remote)")
    serve_parser.add_argument("--allow-remote", action="store_true",
                              help="serve on an address other machines reach (anyone with the token runs code)")
    serve_parser.add_argument("--port", type=non_negative_int, default=8080, help="0: any free port (printed)")
    serve_parser.add_argument("--token-file", type=file_to_write("a file holding the token"), default=None,
                              help=f"file holding the token callers send (made, mode 600, if missing); default: "
                                   f"${TOKEN_ENV}, else a new token, printed")
    serve_parser.add_argument("--read-timeout-s", type=positive_float, default=READ_TIMEOUT_S,
                              help=f"a request must arrive whole within this (default: {READ_TIMEOUT_S:g})")
    serve_parser.add_argument("--num-workers", type=positive_int, default=4,
                              help="runs at the same time; more requests wait")
    serve_parser.add_argument("--timeout-s", type=positive_float, default=30.0,
                              help="ceiling (and default) of a request's run_timeout, seconds (default: 30)")
    serve_parser.add_argument("--memory-mb", type=positive_int, default=defaults.memory_mb,
                              help="ceiling (and default) of a request's memory_limit_MB, for the whole run")
    serve_parser.add_argument("--max-processes", type=positive_int, default=defaults.max_processes)
    serve_parser.add_argument("--max-file-mb", type=positive_int, default=defaults.max_file_mb)
    serve_parser.add_argument("--max-output-chars", type=positive_int, default=defaults.max_output_chars)
    serve_parser.add_argument("--network", action="store_true",
                              help="let the code use the network: this machine's too (every localhost port, Ray's "
                                   "included)")
    serve_parser.add_argument("--isolation", default="auto", choices=ISOLATION_CHOICES,
                              help="auto | namespaces | none (none: no network or file-system isolation)")
    return parser


def read_token(token_file: str | None) -> tuple[str, str]:
    """(token, where it came from): the file (made with a new token, mode 600, when missing; refused when
    others may read or write it), else $POSTTRAIN_SANDBOX_TOKEN, else a new one."""
    if token_file:
        path = os.path.expanduser(token_file)
        try:
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            mode = os.stat(path).st_mode
            if mode & 0o077:
                raise ConfigError(f"posttrain sandbox serve: --token-file {path} is mode {mode & 0o777:o}: others may "
                                  f"read it; chmod 600 {path}") from None
            token = open(path, encoding="utf-8").read().strip()
            if len(token) < 16:
                raise ConfigError(f"posttrain sandbox serve: --token-file {path} holds {len(token)} characters; "
                                  "a token needs at least 16") from None
            return token, f"from {path}"
        token = secrets.token_urlsafe(32)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        return token, f"new, written to {path}"
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], f"from ${TOKEN_ENV}"
    return secrets.token_urlsafe(32), "new"


def _check_host(host: str, allow_remote: bool) -> None:
    if host in LOOPBACK or host.startswith("127."):
        return
    if not allow_remote:
        raise ConfigError(f"posttrain sandbox serve --host {host}: other machines could reach this server and run "
                          f"code on this one (with the token); serve on 127.0.0.1, or add --allow-remote")
    print(f"posttrain sandbox: WARNING: serving on {host}: anyone who reaches this port and holds the token runs "
          "code here", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    _check_host(args.host, args.allow_remote)
    token, source = read_token(args.token_file)
    limits = Limits(timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_processes=args.max_processes,
                    max_file_mb=args.max_file_mb, max_output_chars=args.max_output_chars, network=args.network,
                    isolation=args.isolation)
    sandbox = LocalSandbox(limits, num_workers=args.num_workers)
    in_flight = _InFlight()
    try:
        server = _Server((args.host, args.port), make_handler(sandbox, token, in_flight, args.read_timeout_s),
                         max_connections=4 * args.num_workers + 16)
    except OSError as error:
        raise ConfigError(f"posttrain sandbox serve: cannot bind {args.host}:{args.port}: {error}") from None
    host, port = server.server_address[:2]
    if args.network:
        print("posttrain sandbox: WARNING: --network: the code reaches the network and every port of this machine's "
              "localhost (Ray's GCS and dashboard included)", file=sys.stderr, flush=True)
    stopped_by = []
    signal.signal(signal.SIGTERM, lambda signum, frame: _stop_serving(signum, stopped_by))
    print(f"posttrain sandbox: serving POST http://{host}:{port}/run_code; isolation: {sandbox.isolation}; "
          f"{args.num_workers} workers; time-out {args.timeout_s:g} s (a request's run_timeout may lower it)", flush=True)
    shown = token if source.startswith("new") and not args.token_file else "(not shown)"
    print(f"posttrain sandbox: token {source}: {shown}; callers send 'Authorization: Bearer <token>' (the posttrain "
          f"tool: ${TOKEN_ENV} or its sandbox_token_file)", flush=True)
    print(f"posttrain sandbox: limits of each run (a request's run_timeout and memory_limit_MB may lower the first "
          "and third): "
          f"{limits_words(limits, args.num_workers)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        stopped_by.append(signal.SIGINT)
    except SystemExit:
        pass
    finally:
        server.socket.close()  # no new connection; those queued are refused
        sandbox.close()  # runs in flight end now, not at their own time-outs, and each caller gets its answer
        in_flight.wait_idle(args.read_timeout_s)
    return 128 + stopped_by[0] if stopped_by else 0


def _stop_serving(signum: int, stopped_by: list) -> None:
    stopped_by.append(signum)
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """`posttrain sandbox serve ...`."""
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
