"""A client of SandboxFusion's ``POST /run_code`` (or ``posttrain sandbox serve``, which speaks the
same JSON), and the process-wide limit on calls in flight that verl's ``enable_global_rate_limit`` asks for.

Request: ``{"code", "language", "run_timeout", "memory_limit_MB", "stdin"}``. Response:
``{"status": "Success"|"Failed"|"SandboxError", "message", "run_result": {"status":
"Finished"|"TimeLimitExceeded"|"Error", "execution_time", "return_code", "stdout", "stderr"}}``.
Only the standard library is used (``urllib`` in the caller's worker thread). A ``token`` is sent as
``Authorization: Bearer <token>`` (what `posttrain sandbox serve` asks for); an answer is read up to
``MAX_ANSWER_BYTES`` and no further.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["RunOutcome", "post_run_code", "shared_limit", "API_RETRIES", "REQUEST_MARGIN_S", "NOT_KILLED"]

logger = logging.getLogger(__name__)

API_RETRIES = 3  # attempts when the server cannot be reached or answers 5xx (verl's client retries 3 times)
REQUEST_MARGIN_S = 10.0  # the HTTP time-out is the run time-out plus this (verl's client adds 10 s)
RETRY_PAUSE_S = 0.5
NOT_KILLED = ("ok", "error", "sandbox_error")  # posttrain's sandbox statuses that are not a limit's kill
MAX_ANSWER_BYTES = 16 << 20  # a server's answer past this is an error, not read whole into memory
TOKEN_ENV = "POSTTRAIN_SANDBOX_TOKEN"  # the token `posttrain sandbox serve` printed (or its --token-file's)


@dataclass
class RunOutcome:
    """What one run did, in the terms the tool reports: ``text`` for the model, ``error`` when the code
    failed or could not run, ``kill`` the limit that ended it (``timeout``, ``memory``, ...) or None."""

    text: str
    error: bool = False
    kill: str | None = None


def post_run_code(url: str, code: str, language: str, timeout_s: float, memory_mb: int,
                  token: str | None = None) -> RunOutcome:
    """Run ``code`` on the SandboxFusion server at ``url``; never raises (failures are outcomes)."""
    body = json.dumps({"code": code, "language": language, "run_timeout": timeout_s,
                       "memory_limit_MB": memory_mb, "stdin": ""}).encode()
    problem = ""
    for attempt in range(API_RETRIES):
        if attempt:
            time.sleep(RETRY_PAUSE_S * attempt)
        try:
            return _outcome(_post(url, body, timeout_s + REQUEST_MARGIN_S, token), timeout_s)
        except urllib.error.HTTPError as err:
            problem = f"HTTP {err.code} {err.reason}" + _said(err)
            if err.code == 401:
                problem += f" (set ${TOKEN_ENV}, or the tool's sandbox_token_file, to the server's token)"
            if err.code < 500:
                break  # the server understood and refused: asking again gets the same answer
        except (urllib.error.URLError, OSError) as err:  # refused, reset, or no answer within the time-out
            problem = str(getattr(err, "reason", err))
        except (ValueError, RecursionError) as err:
            problem = f"an answer that is not SandboxFusion's JSON ({type(err).__name__}: {str(err)[:200]})"
            break
    return RunOutcome(f"Error: the sandbox server at {url} failed: {problem}", error=True)


def _post(url: str, body: bytes, timeout_s: float, token: str | None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        data = response.read(MAX_ANSWER_BYTES + 1)
    if len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"an answer over {MAX_ANSWER_BYTES >> 20} MB")
    answer = json.loads(data.decode("utf-8", errors="replace"))
    if not isinstance(answer, dict):
        raise ValueError("not a JSON object")
    return answer


def _said(err: urllib.error.HTTPError) -> str:
    """The server's own words for an error status (its JSON "message"), read up to 4 kB."""
    try:
        message = json.loads(err.read(4096).decode("utf-8", errors="replace")).get("message")
    except (OSError, ValueError, RecursionError, AttributeError):
        return ""
    return f": {message[:300]}" if isinstance(message, str) and message else ""


def _outcome(answer: dict, timeout_s: float) -> RunOutcome:
    """verl shows the model stdout then stderr; a time-out or a sandbox failure says so in words."""
    run = answer.get("run_result") or {}
    text = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
    if run.get("status") == "TimeLimitExceeded":
        return RunOutcome(f"{text}Error: the code ran past its time limit of {timeout_s:g} s and was stopped",
                          error=True, kill="timeout")
    if answer.get("status") == "SandboxError" or not run:
        return RunOutcome(f"Error: the sandbox could not run the code: {answer.get('message') or 'no run result'}",
                          error=True)
    failed = answer.get("status") != "Success" or run.get("return_code") not in (0, None)
    ours = answer.get("posttrain") or {}  # `posttrain sandbox serve` names the limit that ended the run
    kill = ours.get("status") if ours.get("status") not in (None, *NOT_KILLED) else None
    limit_line = f"[sandbox: {ours['limit_hit']}]" if kill and ours.get("limit_hit") else ""
    return RunOutcome(text + limit_line, error=failed, kill=kill)


_SHARED: dict[str, tuple[int, threading.BoundedSemaphore]] = {}
_SHARED_LOCK = threading.Lock()


def shared_limit(size: int) -> threading.BoundedSemaphore:
    """The process's one limit on sandbox calls in flight (verl's named ``rate-limiter`` actor: the
    first tool to ask sets its size; later tools share it whatever their own ``rate_limit``)."""
    with _SHARED_LOCK:
        first, limit = _SHARED.setdefault("rate-limiter", (size, threading.BoundedSemaphore(size)))
    if first != size:
        logger.warning("rate_limit=%d: the process-wide limit (enable_global_rate_limit) already holds %d calls in "
                       "flight, set by the first tool; this tool shares it", size, first)
    return limit
