"""The local web server of `posttrain view`: the page and its script (shipped in ``static/``, nothing
fetched from elsewhere) and a small JSON/text API over the runs' files, on 127.0.0.1 only.

=====================================  ==================================================================
GET /                                  the page (``static/index.html``); /app.js, /style.css its parts
GET /api/runs                          ``{"runs": [{name, path, metrics, train, val, cards}], "title",
                                       "beside": the run shown beside the first, or null}``
GET /api/tail?run=I&what=W&offset=N    whole lines of ``metrics.jsonl`` (W=metrics) or a dump's
                                       ``index.jsonl`` (W=train, val) from byte N; the next offset in the
                                       ``X-Offset`` header, ``X-Reset: 1`` when the file was written anew
GET /api/step?run=I&kind=K&step=S      a step's ``<step>.jsonl`` as written (K=train, val)
GET /api/cards?run=I                   ``{"files": [...]}``: the run's eval cards (`Run.cards`), in step order
GET /api/card?run=I&file=F             ``{"file", "data"}``: one of them
=====================================  ==================================================================

An error is ``{"error": "<one line>"}`` with status 404 (a missing run, step or file) or 400.
"""

from __future__ import annotations

import errno
import json
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from posttrain.trainer.rollout_dump import INDEX
from posttrain.view.runs import Run, ViewError, read_tail

__all__ = ["ViewServer", "make_server"]

STATIC = Path(__file__).with_name("static")
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"), "/style.css": ("style.css", "text/css; charset=utf-8")}
HOST = "127.0.0.1"


def _natural(name: str) -> list:
    """``step_9`` before ``step_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class ViewServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], runs: list[Run], title: str, beside: int | None):
        self.runs, self.title, self.beside = runs, title, beside
        super().__init__(address, _Handler)


def make_server(runs: list[Run], port: int, title: str = "posttrain view", beside: int | None = None) -> ViewServer:
    """The server bound to 127.0.0.1:``port`` (0: any free port); a port in use is one `ViewError` line.
    ``beside``: the run shown beside the first when the page opens (`posttrain.view.runs.beside`)."""
    try:
        return ViewServer((HOST, port), runs, title, beside)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ViewError(f"port {port} on {HOST} is in use (another posttrain view, or another server): pass "
                            "--port N, or --port 0 for any free port") from None
        raise ViewError(f"cannot listen on {HOST}:{port}: {err.strerror or err}") from None


class _Handler(BaseHTTPRequestHandler):
    server: ViewServer

    def log_message(self, format, *args):  # noqa: A002 - the base class's name; quiet: the page polls
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if url.path in ASSETS:
                name, kind = ASSETS[url.path]
                return self._send((STATIC / name).read_bytes(), kind)
            route = {"/api/runs": self._runs, "/api/tail": self._tail, "/api/step": self._step,
                     "/api/cards": self._cards, "/api/card": self._card}.get(url.path)
            if route is None:
                return self._error(HTTPStatus.NOT_FOUND, f"no such page: {url.path}")
            route(query)
        except ViewError as err:
            self._error(HTTPStatus.NOT_FOUND, str(err))
        except (KeyError, ValueError) as err:
            self._error(HTTPStatus.BAD_REQUEST, f"bad request {self.path}: {err}")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page went away

    # ------------------------------------------------------------------ routes
    def _run(self, query: dict) -> Run:
        i = int(query["run"])
        if not 0 <= i < len(self.server.runs):
            raise ViewError(f"no run {i} (this page shows {len(self.server.runs)})")
        return self.server.runs[i]

    def _runs(self, query: dict) -> None:
        body = {"runs": [r.describe() for r in self.server.runs], "title": self.server.title,
                "beside": self.server.beside}
        self._send(json.dumps(body).encode(), "application/json")

    def _tail(self, query: dict) -> None:
        run, what = self._run(query), query["what"]
        if what == "metrics":
            path = run.metrics
        elif what in ("train", "val"):
            if what not in run.dumps:
                run.refresh()
            path = run.dumps[what] / INDEX if what in run.dumps else None
        else:
            raise ValueError(f"what={what}: one of metrics, train, val")
        offset = int(query.get("offset", 0))
        data, offset, reset = read_tail(path, offset) if path is not None else (b"", 0, offset > 0)
        self._send(data, "text/plain; charset=utf-8", {"X-Offset": str(offset), "X-Reset": "1" if reset else "0"})

    def _step(self, query: dict) -> None:
        kind = query["kind"]
        if kind not in ("train", "val"):
            raise ValueError(f"kind={kind}: train or val")
        path = self._run(query).step_path(kind, int(query["step"]))
        self._send(path.read_bytes(), "text/plain; charset=utf-8")

    def _cards(self, query: dict) -> None:
        run = self._run(query)
        names = [str(p.relative_to(run.folder)) for p in run.cards()]
        self._send(json.dumps({"files": sorted(names, key=_natural)}).encode(), "application/json")

    def _card(self, query: dict) -> None:
        run, name = self._run(query), query["file"]
        by_name = {str(p.relative_to(run.folder)): p for p in run.cards()}
        if name not in by_name:
            raise ViewError(f"run {run.name} has no eval card {name}")
        try:
            data = json.loads(by_name[name].read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ViewError(f"{by_name[name]} is not readable JSON ({err})") from None
        self._send(json.dumps({"file": name, "data": data}, default=str).encode(), "application/json")

    # ------------------------------------------------------------------ replies
    def _send(self, body: bytes, kind: str, headers: dict | None = None) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
