"""A judge client that cannot stall a run: any OpenAI-compatible endpoint (``posttrain serve``, vLLM, a
hosted API) asked for a verdict, with limits on everything that can go wrong.

    judge = Judge("http://127.0.0.1:8000/v1", timeout_s=20, max_concurrent=8, max_rps=5, on_error="zero")
    score = await judge.score([{"role": "user", "content": prompt}], parse=last_number)   # in async code
    score = judge.score_sync(messages, parse=last_number)                                   # in sync code
    judge.metrics()   # {"reward/judge_requests": ..., "reward/judge_timeout": ..., ...}

What each row costs at most: ``timeout_s``, counted from the moment the row's request may go (a
concurrency slot free, the rate limit met) until its verdict, every retry and back-off included; a
server that never answers costs exactly that, then the row fails as ``timeout``. ``timeout_s=None``
waits for ever (the tests' negative control shows that a hanging judge then hangs the step).

Retries (``retries`` more tries, back-off ``backoff_s * 2**k`` with jitter, capped by ``max_backoff_s``
and by the time left): a refused or dropped connection, HTTP 429 (its ``Retry-After`` honoured when it
fits), HTTP 5xx, a body that is not OpenAI's JSON. Not retried: other 4xx (the request is wrong) and an
answer the ``parse`` function cannot read (asking again gives the same answer at temperature 0).

Identical requests (the same JSON) are answered once: a request equal to one in flight waits for it,
and answers are kept in an LRU cache of ``cache_size`` entries (0: off). A failure is never cached.

Every failed row is counted by its cause, as the metrics ``reward/judge_<cause>``: ``timeout``,
``connect`` (refused, reset, DNS), ``rate_limited`` (429 after the retries), ``http_4xx``, ``http_5xx``,
``bad_response`` (not OpenAI's JSON), ``unparsable`` (``parse`` raised or gave no finite number); with
``rows`` (verdicts asked), ``failed_rows``, ``requests`` (HTTP requests sent), ``retries`` (tries that
failed and were tried again) and ``cache_hits`` (rows answered by an earlier or in-flight request). Each failed
row is then handled per ``on_error``: ``"raise"`` raises :class:`JudgeError` naming the cause and
the endpoint; ``"zero"`` returns ``error_score`` (0.0).

``base_url`` may be an OpenAI base URL (``http://host:port/v1``), a server root (``http://host:port``,
``/v1`` added) or verl's ``reward_router_address`` (``host:port``). ``model`` None asks ``/models``
once and takes the first. Needs ``httpx`` (the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

from posttrain.errors import PosttrainError

__all__ = ["Judge", "JudgeError", "CAUSES", "add_remote_counts", "chat_complete", "judge_for", "judge_metrics",
           "last_number", "normalize_base_url", "set_default_limits"]

CAUSES = ("timeout", "connect", "rate_limited", "http_4xx", "http_5xx", "bad_response", "unparsable")
COUNTERS = ("requests", "retries", "cache_hits", "rows", "failed_rows") + CAUSES
METRIC_PREFIX = "reward/judge_"


class JudgeError(PosttrainError, RuntimeError):
    """A judge request failed (``cause`` one of :data:`CAUSES`) and ``on_error`` is ``raise``."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class _Failure(Exception):
    def __init__(self, cause: str, detail: str, retry: bool, wait_s: float | None = None):
        super().__init__(detail)
        self.cause, self.retry, self.wait_s = cause, retry, wait_s


def normalize_base_url(base_url: str) -> str:
    """``host:port`` -> ``http://host:port/v1``; ``http://host:port`` -> ``.../v1``; a ``/v1`` URL unchanged."""
    url = base_url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    return url if "/" in rest else f"{url}/v1"


def last_number(text: str) -> float:
    """The last number in ``text`` (``"... Score: 7"`` -> 7.0); ValueError when there is none."""
    import re

    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    if not found:
        raise ValueError(f"no number in the judge's answer {text[:80]!r}")
    return float(found[-1])


class Judge:
    """An OpenAI-compatible endpoint with a time-out, retries, limits and a cache (module docstring).

    Args:
        base_url: the endpoint (``http://host:port/v1``, ``http://host:port`` or ``host:port``).
        model: the ``model`` field of each request; None: the first model ``/models`` lists.
        api_key: sent as ``Authorization: Bearer``; None: no header.
        timeout_s: the most one row may take once its request may go (retries included); None: no limit.
        retries: tries after the first for a retryable failure.
        backoff_s, max_backoff_s: back-off before retry ``k``: ``backoff_s * 2**k`` (jittered), at most this.
        max_concurrent: requests in flight at once.
        max_rps: requests started per second at most (None: no limit).
        cache_size: identical requests remembered (0: no cache; in-flight duplicates are still shared).
        on_error: ``"raise"`` (:class:`JudgeError`) or ``"zero"`` (``error_score`` for a failed row).
        error_score: the score of a failed row under ``on_error="zero"``.
        defaults: request fields added to every request (e.g. ``temperature=0, max_tokens=64``).
        transport: an ``httpx`` transport (tests).
    """

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float | None = 30.0, retries: int = 2, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 max_concurrent: int = 8, max_rps: float | None = None, cache_size: int = 4096,
                 on_error: str = "zero", error_score: float = 0.0, defaults: dict | None = None,
                 transport: Any = None):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_rps is not None and max_rps <= 0:
            raise ValueError(f"max_rps must be > 0 or None, got {max_rps}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.base_url = normalize_base_url(base_url)
        self.model, self.api_key = model, api_key
        self.timeout_s, self.retries = timeout_s, int(retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.max_concurrent, self.max_rps = int(max_concurrent), max_rps
        self.cache_size, self.on_error, self.error_score = int(cache_size), on_error, float(error_score)
        self.defaults = dict(defaults or {"temperature": 0.0})
        self.transport = transport
        self.counts = {name: 0 for name in COUNTERS}
        self._count_lock = threading.Lock()
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._per_loop: dict[int, _LoopState] = {}
        self._sync_loop: _BackgroundLoop | None = None
        _ALL.add(self)

    # ------------------------------------------------------------------ public
    async def chat(self, messages: list[dict], **fields: Any) -> str | None:
        """The judge's answer text for ``messages`` (extra request ``fields`` over ``defaults``); on a
        failure: raises :class:`JudgeError` (``on_error="raise"``) or returns None (``"zero"``)."""
        self._count("rows")
        try:
            return await self._answer(messages, fields)
        except _Failure as failure:
            return self._failed(failure)

    async def score(self, messages: list[dict], parse: Callable[[str], float] = last_number, **fields: Any) -> float:
        """``parse(answer)`` as a float; a failed request or an unparsable answer scores per ``on_error``."""
        self._count("rows")
        try:
            text = await self._answer(messages, fields)
            try:
                value = float(parse(text))
            except Exception as err:  # garbage from the judge: counted, never a crash
                raise _Failure("unparsable", f"{type(err).__name__}: {err}", retry=False) from None
            if not math.isfinite(value):
                raise _Failure("unparsable", f"parse gave {value}", retry=False)
            return value
        except _Failure as failure:
            result = self._failed(failure)
            return self.error_score if result is None else result

    def score_sync(self, messages: list[dict], parse: Callable[[str], float] = last_number, **fields: Any) -> float:
        """:meth:`score` from synchronous code (a private event loop in a background thread)."""
        return self._background().run(self.score(messages, parse, **fields))

    def chat_sync(self, messages: list[dict], **fields: Any) -> str | None:
        """:meth:`chat` from synchronous code."""
        return self._background().run(self.chat(messages, **fields))

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """The counters as ``reward/judge_<name>`` metrics; ``reset`` zeroes them after reading."""
        with self._count_lock:
            out = {METRIC_PREFIX + k: float(v) for k, v in self.counts.items()}
            if reset:
                self.counts = {name: 0 for name in COUNTERS}
        return out

    def close(self) -> None:
        if self._sync_loop is not None:
            self._sync_loop.stop()
            self._sync_loop = None

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, by: int = 1) -> None:
        with self._count_lock:
            self.counts[name] += by

    def _failed(self, failure: _Failure) -> None:
        self._count(failure.cause)
        self._count("failed_rows")
        if self.on_error == "raise":
            raise JudgeError(f"judge at {self.base_url} failed ({failure.cause}): {failure}; reward.on_error=zero "
                             "scores such rows 0 and counts them", failure.cause)
        return None

    def _background(self) -> "_BackgroundLoop":
        if self._sync_loop is None:
            self._sync_loop = _BackgroundLoop()
        return self._sync_loop

    def _state(self) -> "_LoopState":
        """The client, semaphore and rate-limit clock of the running event loop (each loop has its own)."""
        loop = asyncio.get_running_loop()
        for key in [k for k, v in self._per_loop.items() if v.loop.is_closed()]:  # asyncio.run's finished loops
            del self._per_loop[key]
        state = self._per_loop.get(id(loop))
        if state is None or state.loop is not loop:
            state = _LoopState(loop, self)
            self._per_loop[id(loop)] = state
        return state

    async def _answer(self, messages: list[dict], fields: dict) -> str:
        state = self._state()
        payload = {**self.defaults, **fields, "messages": messages}
        if self.model is not None or "model" in payload:
            payload.setdefault("model", self.model)
        key = json.dumps(payload, sort_keys=True, default=str)
        if key in self._cache:
            self._cache.move_to_end(key)
            self._count("cache_hits")
            return self._cache[key]
        shared = state.in_flight.get(key)
        if shared is not None:
            self._count("cache_hits")
            return await asyncio.shield(shared)
        task = asyncio.ensure_future(self._limited(state, payload))
        task.add_done_callback(_retrieved)  # its failure reaches every row waiting on it; none left unread
        state.in_flight[key] = task
        try:
            text = await asyncio.shield(task)
        finally:
            state.in_flight.pop(key, None)
        if self.cache_size > 0:
            self._cache[key] = text
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return text

    async def _limited(self, state: "_LoopState", payload: dict) -> str:
        async with state.slots:
            await state.wait_for_rate()
            try:
                if self.timeout_s is None:
                    return await self._with_retries(state, payload, None)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.timeout_s
                async with asyncio.timeout_at(deadline):
                    return await self._with_retries(state, payload, deadline)
            except TimeoutError:
                raise _Failure("timeout", f"no answer within {self.timeout_s:g} s (timeout_s)", retry=False) from None

    async def _with_retries(self, state: "_LoopState", payload: dict, deadline: float | None) -> str:
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                await state.wait_for_rate()
            try:
                return await self._once(state, payload)
            except _Failure as failure:
                if not failure.retry or attempt == self.retries:
                    raise
                pause = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                if failure.wait_s is not None:
                    pause = max(pause, failure.wait_s)
                if deadline is not None and asyncio.get_running_loop().time() + pause >= deadline:
                    raise  # no time left for another try: report this failure, not a time-out
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def _once(self, state: "_LoopState", payload: dict) -> str:
        import httpx

        client = state.client()
        if payload.get("model") is None:
            payload["model"] = await self._first_model(client)
        self._count("requests")
        try:
            response = await client.post("/chat/completions", json=payload)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            raise _Failure("connect", f"{type(err).__name__}: {err}", retry=True) from None
        except httpx.TimeoutException as err:  # httpx's own limits (the row's deadline is asyncio's)
            raise _Failure("timeout", f"{type(err).__name__}: {err}", retry=True) from None
        if response.status_code == 429:
            retry_after = _seconds(response.headers.get("retry-after"))
            raise _Failure("rate_limited", f"HTTP 429: {response.text[:200]}", retry=True, wait_s=retry_after)
        if response.status_code >= 500:
            raise _Failure("http_5xx", f"HTTP {response.status_code}: {response.text[:200]}", retry=True)
        if response.status_code >= 400:
            raise _Failure("http_4xx", f"HTTP {response.status_code}: {response.text[:200]}", retry=False)
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failure("bad_response", f"not an OpenAI chat completion: {response.text[:200]!r}",
                           retry=True) from None
        if not isinstance(content, str):
            raise _Failure("bad_response", f"the message content is {type(content).__name__}, not text", retry=True)
        return content

    async def _first_model(self, client: Any) -> str:
        import httpx

        try:
            response = await client.get("/models")
            self.model = response.json()["data"][0]["id"]
        except httpx.TransportError as err:
            raise _Failure("connect", f"GET /models: {type(err).__name__}: {err}", retry=True) from None
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failure("bad_response", "GET /models gave no model; set the judge's model", retry=True) from None
        return self.model


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _LoopState:
    """What a judge keeps per event loop (asyncio objects belong to one loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, judge: Judge):
        self.loop, self.judge = loop, judge
        self.slots = asyncio.Semaphore(judge.max_concurrent)
        self.in_flight: dict[str, asyncio.Future] = {}
        self._next_start = 0.0
        self._client = None

    def client(self):
        if self._client is None:
            import httpx

            j = self.judge
            headers = {"Authorization": f"Bearer {j.api_key}"} if j.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=j.base_url, headers=headers, transport=j.transport, trust_env=False,
                timeout=httpx.Timeout(j.timeout_s if j.timeout_s is not None else None, connect=None),
                limits=httpx.Limits(max_connections=j.max_concurrent + 2, max_keepalive_connections=j.max_concurrent))
        return self._client

    async def wait_for_rate(self) -> None:
        """Requests start at least ``1 / max_rps`` seconds apart."""
        if self.judge.max_rps is None:
            return
        now = self.loop.time()
        start = max(now, self._next_start)
        self._next_start = start + 1.0 / self.judge.max_rps
        if start > now:
            await asyncio.sleep(start - now)


class _BackgroundLoop:
    """An event loop in a daemon thread, for :meth:`Judge.score_sync`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="posttrain-judge-loop", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


# ---------------------------------------------------------------------------- process-wide judges

_ALL: "weakref.WeakSet[Judge]" = weakref.WeakSet()
_BY_ADDRESS: dict[str, Judge] = {}
_DEFAULT_LIMITS: dict[str, Any] = {}


def set_default_limits(**limits: Any) -> None:
    """The keyword arguments :func:`judge_for` gives the judges it builds (a run sets them from its
    ``reward.*`` keys before the first step: ``timeout_s``, ``on_error``, ``max_concurrent``, ...)."""
    _DEFAULT_LIMITS.clear()
    _DEFAULT_LIMITS.update(limits)


def judge_for(address: str, **overrides: Any) -> Judge:
    """The process's judge for ``address`` (verl's ``reward_router_address`` or a URL), built once with the
    run's limits (:func:`set_default_limits`) and ``overrides``; its counters join :func:`judge_metrics`."""
    key = normalize_base_url(address)
    judge = _BY_ADDRESS.get(key)
    if judge is None:
        judge = _BY_ADDRESS[key] = Judge(key, **{**_DEFAULT_LIMITS, **overrides})
    return judge


_REMOTE_COUNTS: dict[str, float] = {}
_REMOTE_LOCK = threading.Lock()


def add_remote_counts(counts: dict[str, float]) -> None:
    """Counters a worker process's judges moved (the ``remote`` reward manager sends them back with each row)."""
    with _REMOTE_LOCK:
        for name, value in counts.items():
            _REMOTE_COUNTS[name] = _REMOTE_COUNTS.get(name, 0.0) + float(value)


def judge_metrics(reset: bool = False) -> dict[str, float]:
    """Every judge's counters in this process (and those worker processes sent back), summed
    (``reward/judge_<name>``); ``reset`` zeroes them."""
    total = {METRIC_PREFIX + k: 0.0 for k in COUNTERS}
    for judge in list(_ALL):
        for name, value in judge.metrics(reset=reset).items():
            total[name] += value
    with _REMOTE_LOCK:
        for name, value in _REMOTE_COUNTS.items():
            total[name] = total.get(name, 0.0) + value
        if reset:
            _REMOTE_COUNTS.clear()
    return total


async def chat_complete(router_address: str, chat_complete_request: dict) -> Any:
    """verl's GenRM helper: ``chat_complete(router_address=..., chat_complete_request={"messages": ...,
    "temperature": ...})`` -> an object with ``.choices[0].message.content``, through the process's judge for
    that address (its time-out, retries, limits and cache). A failed request under ``on_error="zero"``
    gives an empty content (the caller's parser then scores it, as a GenRM function does)."""
    from types import SimpleNamespace

    request = dict(chat_complete_request)
    messages = request.pop("messages")
    text = await judge_for(router_address).chat(messages, **request)
    message = SimpleNamespace(role="assistant", content=text or "")
    return SimpleNamespace(choices=[SimpleNamespace(index=0, message=message, finish_reason="stop")])
