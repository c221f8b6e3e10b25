"""The refusal every part of the server raises: :class:`ServeError` (an HTTP status and OpenAI's error fields)."""

from __future__ import annotations

__all__ = ["ServeError"]


class ServeError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
