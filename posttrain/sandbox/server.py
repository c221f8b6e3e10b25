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
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from posttrain.errors import ConfigError
from posttrain.sandbox.limits import ISOLATION_CHOICES, Limits, RunResult
from posttrain.sandbox.local import LANGUAGES, LocalSandbox

MAX_REQUEST_BYTES = 16 << 20


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
    if not isinstance(request, dict) or not isinstance(request.get("code"), str):
        return sandbox_error('the request needs "code": a string (SandboxFusion\'s /run_code JSON)')
    language = request.get("language", "python")
    if language not in LANGUAGES:
        return sandbox_error(f"unknown language {language!r}; this server runs: {', '.join(LANGUAGES)}")
    stdin = request.get("stdin") or ""
    if not isinstance(stdin, str):
        return sandbox_error('"stdin" must be a string or null')
    return response_for(sandbox.run(request["code"], language, stdin, limits=request_limits(request, sandbox.limits)))


def make_handler(sandbox: LocalSandbox) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/run_code":
                self._send(404, {"detail": f"no route {self.path}; POST /run_code"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_REQUEST_BYTES:
                self._send(413, sandbox_error(f"request over {MAX_REQUEST_BYTES} bytes"))
                return
            self._send(200, answer(self.rfile.read(length), sandbox))

        def do_GET(self) -> None:  # noqa: N802
            self._send(200, {"status": "ok", "isolation": sandbox.isolation, "languages": list(LANGUAGES)})

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
            pass  # one line per call would drown a training log; errors come back in the JSON

    return Handler


def build_parser() -> argparse.ArgumentParser:
    # cli_args is a leaf of argument types (stdlib only): the one import here from outside errors, for the
    # command line alone, so every numeric flag refuses nonsense the way the other commands' flags do
    from posttrain.cli_args import non_negative_int, positive_float, positive_int

    defaults = Limits()
    parser = argparse.ArgumentParser(prog="posttrain sandbox", description="posttrain's sandbox for model code.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="serve")
    serve_parser = actions.add_parser("serve", help="serve SandboxFusion's POST /run_code with the local sandbox",
                                      description="Serve SandboxFusion's POST /run_code with posttrain's local "
                                                  "sandbox; the limits are ceilings of each request's.")
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    serve_parser.add_argument("--port", type=non_negative_int, default=8080, help="0: any free port (printed)")
    serve_parser.add_argument("--num-workers", type=positive_int, default=4,
                              help="runs at the same time; more requests wait")
    serve_parser.add_argument("--timeout-s", type=positive_float, default=30.0,
                              help="ceiling (and default) of a request's run_timeout, seconds")
    serve_parser.add_argument("--memory-mb", type=positive_int, default=defaults.memory_mb,
                              help="ceiling (and default) of a request's memory_limit_MB")
    serve_parser.add_argument("--max-processes", type=positive_int, default=defaults.max_processes)
    serve_parser.add_argument("--max-file-mb", type=positive_int, default=defaults.max_file_mb)
    serve_parser.add_argument("--max-output-chars", type=positive_int, default=defaults.max_output_chars)
    serve_parser.add_argument("--network", action="store_true", help="let the code use the network")
    serve_parser.add_argument("--isolation", default="auto", choices=ISOLATION_CHOICES,
                              help="auto | namespaces | none (none: no network or file-system isolation)")
    return parser


def serve(args: argparse.Namespace) -> int:
    limits = Limits(timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_processes=args.max_processes,
                    max_file_mb=args.max_file_mb, max_output_chars=args.max_output_chars, network=args.network,
                    isolation=args.isolation)
    sandbox = LocalSandbox(limits, num_workers=args.num_workers)
    try:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(sandbox))
    except OSError as error:
        raise ConfigError(f"posttrain sandbox serve: cannot bind {args.host}:{args.port}: {error}") from None
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"posttrain sandbox: serving POST http://{host}:{port}/run_code; isolation: {sandbox.isolation}; "
          f"{args.num_workers} workers", flush=True)
    signal.signal(signal.SIGTERM, _stop_serving)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        sandbox.close()  # runs in flight end now, not at their own time-outs
        server.server_close()
    return 0


def _stop_serving(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """`posttrain sandbox serve ...`."""
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
