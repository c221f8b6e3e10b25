"""A judge endpoint that misbehaves on purpose, for the judge and reward-loop tests (stdlib HTTP, a thread).

    with FakeJudge("hang") as fake:       # every request waits until the test ends (or fake.release())
        Judge(fake.url, timeout_s=0.5)
    modes: "ok" (answers "Score: <n>", n = the number of characters of the last message), "hang", "garbage"
    (HTTP 200, not JSON), "words" (a valid completion whose text has no number), "500" (HTTP 500),
    "429" (HTTP 429, Retry-After 0), "flaky" (HTTP 500 on odd requests, "ok" on even ones).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["FakeJudge", "dead_url"]


def dead_url() -> str:
    """A URL where nothing listens (a port bound and closed again)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/v1"


class FakeJudge:
    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.requests = 0
        self.bodies: list[dict] = []
        self.released = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-judge"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.requests += 1
                fake.bodies.append(body)
                mode = fake.mode
                if mode == "flaky":
                    mode = "500" if fake.requests % 2 else "ok"
                if mode == "hang":
                    fake.released.wait()
                    return self._send(503, b'{"error": "released"}')
                if mode == "garbage":
                    return self._send(200, b"<html>definitely not json")
                if mode == "500":
                    return self._send(500, b'{"error": {"message": "boom"}}')
                if mode == "429":
                    return self._send(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "0"})
                text = "I cannot judge this." if mode == "words" else \
                    f"Score: {len(body['messages'][-1]['content'])}"
                reply = {"id": "x", "object": "chat.completion", "model": body.get("model"),
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}]}
                self._send(200, json.dumps(reply).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that gave up: not news
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> "FakeJudge":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
