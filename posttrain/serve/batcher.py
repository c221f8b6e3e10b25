"""Requests from many clients decoded together: one thread owns the engine and, each time it is free,
takes every waiting request that samples the same way (up to ``max_batch_rows`` rows) into one
``engine.generate`` call. Requests that arrive while a batch decodes wait for the next one, so
under load batches fill by themselves; ``batch_wait_s`` (default 0) holds a batch open a moment
longer for requests sent at the same time.

The engine takes one sampling setting a call, so a batch holds requests with the same temperature,
top-p and top-k (greedy requests together); the rows decode to the longest ``max_tokens`` among
them and each row is cut at its own (a row's first tokens do not depend on how long the batch runs).
A request with a ``seed`` decodes alone under a generator seeded with it, so the same request and
seed give the same tokens whatever else the server is doing. Stop strings cut the text afterwards.

Inside a training process the server runs over the trainer's own engine object: ``engine_lock`` is
held around every ``generate`` call, so the trainer holds it while it changes the weights, and
``recorder`` receives every finished request's prompt ids, sampled ids and log-probs
(:class:`ServeRecord`) with the engine's ``weights_version``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrain.batch import Batch
from posttrain.rollout.base import SamplingParams
from posttrain.serve.protocol import Choice, Job, ServeError, apply_stop

__all__ = ["Batcher", "ServeRecord"]


@dataclass
class ServeRecord:
    """One finished request, for a recorder: ``prompt_token_ids[p]`` and ``choices[p][j]`` (its ``j``-th
    sample of prompt ``p``: ``token_ids``, ``log_probs``, ``finish_reason``)."""

    request_id: str
    kind: str
    key: str | None
    """The API key the client presented (a per-episode key tags the episode)."""
    model: str
    prompt_token_ids: list[list[int]]
    choices: list[list[Choice]]
    weights_version: Any
    submitted: float
    finished: float


@dataclass
class _Pending:
    job: Job
    key: str | None
    future: Future
    rows: int
    submitted: float = field(default_factory=time.monotonic)


class Batcher:
    """Queues :class:`Job` s and decodes them in batches on its own thread (module docstring).

    Args:
        engine: a rollout engine (``generate(Batch, SamplingParams) -> Batch``; ``hf`` or ``vllm``).
        tokenizer: the model's tokenizer (pad id, decoding).
        max_model_len: prompt plus response tokens a row may hold.
        default_max_tokens: ``max_tokens`` of a request that gives none (capped by what the context leaves).
        max_batch_rows: rows (prompts times ``n``) one ``generate`` call decodes at most.
        batch_wait_s: how long a batch waits for more requests once the engine is free.
        max_pending_rows: rows waiting at most; a request beyond it is refused (HTTP 503).
        recorder: called with a :class:`ServeRecord` for every finished request (on this thread).
        admit: ``admit(key) -> bool``, asked when a request is taken for decoding (the engine lock held):
            a request whose key is no longer admitted (an episode that has ended) fails with HTTP 401
            instead of decoding, so nothing decodes once a trainer has closed its episodes.
    """

    def __init__(self, engine: Any, tokenizer: Any, *, max_model_len: int, default_max_tokens: int = 512,
                 max_batch_rows: int = 64, batch_wait_s: float = 0.0, max_pending_rows: int = 4096,
                 recorder: Callable[[ServeRecord], None] | None = None,
                 admit: Callable[[str | None], bool] | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_model_len, self.default_max_tokens = int(max_model_len), int(default_max_tokens)
        self.max_batch_rows, self.batch_wait_s = max(1, int(max_batch_rows)), float(batch_wait_s)
        self.max_pending_rows = int(max_pending_rows)
        self.recorder, self.admit = recorder, admit
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id]
        self.eos_ids = {int(i) for i in eos}
        self.engine_lock = threading.Lock()
        """Held around every ``generate`` call: hold it to change the engine's weights between batches."""
        self.tokenizer_lock = threading.Lock()
        """Held around tokenizer calls (the request parser's and the decoding here): one at a time."""
        self.stats = {"requests": 0, "batches": 0, "rows": 0, "largest_batch_rows": 0, "engine_s": 0.0}
        self._queue: list[_Pending] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ life
    def start(self) -> "Batcher":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="posttrain-serve-batcher", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the batch now decoding; requests still waiting fail with HTTP 503."""
        with self._cond:
            self._stopping = True
            waiting, self._queue = self._queue, []
            self._cond.notify_all()
        for p in waiting:
            p.future.set_exception(ServeError("the server is shutting down", status=503, kind="server_error"))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ queue
    def submit(self, job: Job, key: str | None = None) -> Future:
        """Queue ``job``; the future gives ``choices[p][j]`` (:class:`Choice`) or raises :class:`ServeError`.
        Lengths are checked here, so a request that cannot fit fails before it waits."""
        self._fit(job)
        pending = _Pending(job, key, Future(), rows=len(job.prompts) * job.n)
        with self._cond:
            if self._stopping:
                raise ServeError("the server is shutting down", status=503, kind="server_error")
            waiting = sum(p.rows for p in self._queue)
            if waiting + pending.rows > self.max_pending_rows:
                raise ServeError(f"the server is busy ({waiting} rows waiting); retry later", status=503,
                                 kind="server_error", code="overloaded")
            self._queue.append(pending)
            self._cond.notify()
        return pending.future

    def _fit(self, job: Job) -> None:
        longest = max(len(p) for p in job.prompts)
        room = self.max_model_len - longest
        if room < 1:
            raise ServeError(f"the prompt has {longest} tokens; this model's context is {self.max_model_len} tokens",
                             param="messages" if job.kind == "chat" else "prompt", code="context_length_exceeded")
        if job.max_tokens is None:
            job.max_tokens = min(self.default_max_tokens, room)
        elif job.max_tokens > room:
            raise ServeError(f"max_tokens={job.max_tokens} plus the prompt's {longest} tokens is more than this "
                             f"model's context of {self.max_model_len} tokens", param="max_tokens",
                             code="context_length_exceeded")

    def _take(self) -> list[_Pending] | None:
        """The next batch: the oldest request and every later one that samples the same way, up to
        ``max_batch_rows`` rows (a request larger than that goes alone). None when stopping."""
        with self._cond:
            if self._stopping or not self._queue:
                return None
            key = self._queue[0].job.group_key()
            batch, rows, rest = [], 0, []
            for p in self._queue:
                if p.job.group_key() == key and (not batch or rows + p.rows <= self.max_batch_rows):
                    batch.append(p)
                    rows += p.rows
                else:
                    rest.append(p)
            self._queue = rest
            return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            if self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)
            # the batch is taken once the engine is ours: requests that arrive while a trainer holds the lock
            # (or while the previous batch decodes) all join this one
            with self.engine_lock:
                batch = self._take()
                if batch:
                    self._run(batch)

    def _run(self, batch: list[_Pending]) -> None:
        if self.admit is not None:
            closed = [p for p in batch if not self.admit(p.key)]
            for p in closed:
                if p.future.set_running_or_notify_cancel():
                    p.future.set_exception(ServeError("this API key's episode has ended", status=401,
                                                      code="invalid_api_key"))
            batch = [p for p in batch if p not in closed]
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = self._decode([p.job for p in live])
        except ServeError as err:
            for p in live:
                p.future.set_exception(err)
            return
        except Exception as err:  # an engine failure fails this batch's requests, never the server
            error = ServeError(f"generation failed: {type(err).__name__}: {err}", status=500, kind="server_error")
            for p in live:
                p.future.set_exception(error)
            return
        for p, choices in zip(live, results):
            self._record(p, choices)  # first: a client that sends its next request at once finds this one recorded
            p.future.set_result(choices)

    def _record(self, p: _Pending, choices: list[list[Choice]]) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder(ServeRecord(p.job.id, p.job.kind, p.key, p.job.model, [list(x) for x in p.job.prompts],
                                      choices, getattr(self.engine, "weights_version", None), p.submitted,
                                      time.monotonic()))
        except Exception as err:  # a recorder's bug must not stop the server; say it once per request
            print(f"posttrain serve: the recorder failed on request {p.job.id}: {type(err).__name__}: {err}")

    # ------------------------------------------------------------------ decoding
    def _decode(self, jobs: list[Job]) -> list[list[list[Choice]]]:
        """Every job's prompts, ``n`` rows each, in one engine call (``engine_lock`` held) -> per job
        ``choices[p][j]``."""
        rows = [(j, p, ids) for j, job in enumerate(jobs) for p, ids in enumerate(job.prompts) for _ in range(job.n)]
        first = jobs[0]
        sampling = SamplingParams(n=1, temperature=0.0 if first.greedy else first.temperature,
                                  top_p=1.0 if first.greedy else first.top_p, top_k=-1 if first.greedy else first.top_k,
                                  do_sample=not first.greedy, response_length=max(job.max_tokens for job in jobs),
                                  calculate_log_probs=True)
        prompts = self._prompt_batch([ids for _, _, ids in rows])
        started = time.perf_counter()
        if first.seed is not None:
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(first.seed)
                out = self.engine.generate(prompts, sampling)
        else:
            out = self.engine.generate(prompts, sampling)
        self.stats["engine_s"] += time.perf_counter() - started
        self.stats["batches"] += 1
        self.stats["requests"] += len(jobs)
        self.stats["rows"] += len(rows)
        self.stats["largest_batch_rows"] = max(self.stats["largest_batch_rows"], len(rows))
        responses = out["responses"].cpu()
        mask = out["response_mask"].cpu()
        log_probs = out["rollout_log_probs"].cpu() if "rollout_log_probs" in out else torch.zeros(responses.shape)
        results: list[list[list[Choice]]] = [[[] for _ in job.prompts] for job in jobs]
        with self.tokenizer_lock:
            for r, (j, p, _) in enumerate(rows):
                length = min(int(mask[r].sum()), jobs[j].max_tokens)
                ids = responses[r, :length].tolist()
                ended = bool(ids) and ids[-1] in self.eos_ids
                results[j][p].append(apply_stop(ids, log_probs[r, :length].tolist(), ended, jobs[j].stop,
                                                self.tokenizer))
        return results

    def _prompt_batch(self, prompts: list[list[int]]) -> Batch:
        """Left-padded ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P]`` (the engines' input)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        position = torch.clamp(mask.cumsum(-1) - 1, min=0)
        return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position})
