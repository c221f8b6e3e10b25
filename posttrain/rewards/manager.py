"""The reward manager: decode each response, score it, put the score on its last valid token.

Like verl's ``NaiveRewardManager``, with three differences: it returns ``(token_level_scores,
extra)`` instead of a bare tensor; a failing scorer either raises an error naming the row and
data_source (``on_error="raise"``) or scores 0 and is counted (``on_error="zero"``); and
``num_workers > 0`` scores rows in a process pool with results identical to the serial path.

With ``reward_model.reward_manager=dapo`` it does what verl's ``DAPORewardManager`` adds: a
plain-number score is also recorded as ``acc`` (DAPO's dynamic sampling compares it), and the
overlong buffer (:class:`OverlongBuffer`) lowers the score of responses that run into the last
tokens of ``data.max_response_length``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import numbers
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from posttrain.batch import Batch, response_mask_of
from posttrain.errors import PosttrainError
from posttrain.rewards._worker import die_with_parent, exit_message, is_finite_number, score_chunk, score_row
from posttrain.rewards.dispatch import default_compute_score

__all__ = ["ERRORS_KEY", "RewardManager", "BatchRewardFn", "OverlongBuffer", "RewardError", "RewardInterrupted",
           "numeric_columns", "overlong_penalty", "place_on_last_token", "response_mask_of", "scoring_in_progress"]

ERRORS_KEY = "reward/errors"


class RewardError(PosttrainError, RuntimeError):
    """A scorer failed, hung or returned nan/inf on one row; the message names the row and its data_source."""


class RewardInterrupted(BaseException):
    """SIGINT/SIGTERM arrived while rewards were being computed: the trainer's signal handler raises it
    there (a BaseException, so scorers' ``except Exception`` cannot swallow it) to stop at once."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_SCORING = 0


def scoring_in_progress() -> bool:
    """True while a reward manager or batch reward function is running in this process."""
    return _SCORING > 0


def _where(tb: str) -> str:
    """`` (at file:line)`` of the innermost frame of a scorer's traceback text (the full one: --debug)."""
    import re

    frames = re.findall(r'File "([^"]+)", line (\d+)', tb or "")
    return f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""


@contextlib.contextmanager
def _scoring():
    global _SCORING
    _SCORING += 1
    try:
        yield
    finally:
        _SCORING -= 1


def _row_name(i: int, data_source: Any, extra_info: Any) -> str:
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    return f"row {i} (data_source={data_source!r}" + (f", extra_info.index={index!r})" if index is not None else ")")


def _function_name(fn: Callable) -> str:
    """``compute_score (in /path/reward.py)`` for a custom function, else the function's name."""
    path = getattr(fn, "path", None)
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{name} (in {path})" if path else str(name)


def _valid_response_tokens(batch: Batch, response_mask: torch.Tensor) -> torch.Tensor:
    """The response part of ``attention_mask`` when the batch has one, else ``response_mask``."""
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -response_mask.shape[1] :]
    return response_mask


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``scores [N]`` -> ``[N, R]`` float32 zeros with each score at its row's last valid token.

    A row with no valid token keeps its score at column 0, so estimators that sum a row still see it.
    """
    n, r = response_mask.shape
    if scores.shape != (n,):
        raise ValueError(f"expected one score per row, shape [{n}], got {list(scores.shape)}")
    mask = response_mask.bool()
    cols = torch.arange(r, device=mask.device).expand(n, r)
    last = torch.where(mask, cols, torch.full_like(cols, -1)).max(dim=1).values.clamp(min=0)
    out = torch.zeros((n, r), dtype=torch.float32, device=mask.device)
    out[torch.arange(n, device=mask.device), last] = scores.to(torch.float32).to(mask.device)
    return out


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's overlong reward shaping (``reward_model.overlong_buffer``), with the response limit it
    is measured against (``data.max_response_length``)."""

    length: int
    """Tokens at the end of the limit where the penalty grows (``overlong_buffer.len``)."""
    penalty_factor: float
    """Penalty of a response as long as the limit."""
    max_response_length: int
    log: bool = False
    """Record ``overlong_reward`` and ``overlong`` (1.0 where penalised) per row in ``extra``."""

    def __post_init__(self):
        if not 0 < self.length <= self.max_response_length:
            raise ValueError(f"the overlong buffer length must be in 1..{self.max_response_length} "
                             f"(max_response_length), got {self.length}")


def overlong_penalty(valid_length: torch.Tensor, buffer: OverlongBuffer) -> torch.Tensor:
    """``[N]`` penalties (<= 0, float64) for responses of ``valid_length [N]`` tokens, EOS included.

    verl's ``DAPORewardManager``: ``min(-(L - (max_len - len)) / len * penalty_factor, 0)``, with ``L``
    the response's valid tokens (its attention mask over the response, so an EOS counts). A response
    of exactly ``max_len - len`` tokens is not penalised; each token beyond costs
    ``penalty_factor / len``; one that fills ``max_len`` loses ``penalty_factor``.
    """
    expected = buffer.max_response_length - buffer.length
    exceed = valid_length.to(torch.float64) - expected
    return (-exceed / buffer.length * buffer.penalty_factor).clamp(max=0.0)


def numeric_columns(extra: dict) -> dict[str, np.ndarray]:
    """The reward's extra output as float64 arrays, one per key that holds numbers (keys holding
    strings or other objects are left out): what metrics can average."""
    out = {}
    for name, values in (extra or {}).items():
        try:
            out[name] = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            continue
    return out


def _stack_extra(values: list[dict], n: int) -> dict[str, np.ndarray]:
    keys = list(dict.fromkeys(k for v in values for k in v))
    out = {}
    for k in keys:
        col = [v.get(k) for v in values]
        if all(isinstance(x, (numbers.Number, np.number)) or x is None for x in col):
            out[k] = np.array([np.nan if x is None else float(x) for x in col], dtype=np.float64)
        else:
            arr = np.empty(n, dtype=object)
            arr[:] = col
            out[k] = arr
    return out


class RewardManager:
    """Scores a batch of responses with a per-row function.

    Args:
        tokenizer: decodes ``responses`` (special tokens skipped).
        compute_score: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
            ``None`` uses :func:`default_compute_score`. For ``num_workers > 0`` it must be picklable
            (a module-level function, or a :class:`CustomRewardFn`).
        reward_fn_key: the non-tensor key passed as ``data_source`` (``data.reward_fn_key``).
        num_workers: 0 scores in this process; ``k > 0`` uses a pool of ``k`` spawned processes.
        on_error: ``"raise"`` re-raises a scorer failure as :class:`RewardError` naming the row and
            data_source; ``"zero"`` scores the row 0 and marks it in ``extra["reward/errors"]``.
        record_acc: also record a plain-number score as ``extra["acc"]`` (before any overlong
            penalty), as verl's DAPO reward manager does; a failed row records 0.
        overlong: add :func:`overlong_penalty` to every row's score (None: off).

    ``__call__(batch)`` reads ``responses [N, R]``, ``response_mask [N, R]`` (or the response part
    of ``attention_mask``), ``reward_model[i]["ground_truth"]``, ``batch[reward_fn_key]`` and
    ``extra_info`` (optional) and returns ``(token_level_scores [N, R] float32, extra)``, where
    ``extra`` maps names to per-row arrays: the fields of dict scores (``score`` included) and
    ``reward/errors`` (1.0 where the scorer failed).
    """

    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_workers: int = 0,
        on_error: str = "raise",
        mp_context: str = "spawn",
        timeout_s: float | None = 60.0,
        record_acc: bool = False,
        overlong: OverlongBuffer | None = None,
    ):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.reward_fn_key = reward_fn_key
        self.num_workers = num_workers
        self.on_error = on_error
        self.mp_context = mp_context
        self.timeout_s = float(timeout_s) if timeout_s else None
        self.record_acc = record_acc
        self.overlong = overlong
        self._pool: ProcessPoolExecutor | None = None

    # ---------------------------------------------------------------- inputs
    def _jobs(self, batch: Batch) -> tuple[list[tuple], torch.Tensor]:
        mask = response_mask_of(batch)
        responses = batch["responses"]
        n = len(batch)
        for key in ("reward_model", self.reward_fn_key):
            if key not in batch.non_tensor_batch:
                raise KeyError(f"the batch has no non-tensor key {key!r} needed for scoring; keys: {batch.keys()}")
        # the text scored is every valid response token (verl's): the same as the mask's in a single-turn
        # rollout; in a multi-turn one the tool/user turns too, which keep the model's turns apart
        mask_b = _valid_response_tokens(batch, mask).bool().cpu()
        ids = [responses[i].cpu()[mask_b[i]].tolist() for i in range(n)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        extras = batch.non_tensor_batch.get("extra_info")
        jobs = []
        for i in range(n):
            rm = batch["reward_model"][i]
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise KeyError(f"row {i}: reward_model has no 'ground_truth' (got {rm!r})")
            extra = extras[i] if extras is not None and extras[i] is not None else {}
            jobs.append((i, batch[self.reward_fn_key][i], texts[i], rm["ground_truth"], extra))
        return jobs, mask

    # ---------------------------------------------------------------- scoring
    def _run(self, jobs: list[tuple]) -> list[tuple]:
        if self.num_workers == 0 or len(jobs) <= 1:
            return [score_row(self.compute_score, *job, timeout=self.timeout_s) for job in jobs]
        if self._pool is None:
            ctx = multiprocessing.get_context(self.mp_context)
            self._pool = ProcessPoolExecutor(max_workers=self.num_workers, mp_context=ctx, initializer=die_with_parent)
        size = max(1, -(-len(jobs) // (4 * self.num_workers)))
        chunks = [jobs[s : s + size] for s in range(0, len(jobs), size)]
        futures = [self._pool.submit(score_chunk, self.compute_score, c, self.timeout_s) for c in chunks]
        try:
            self._wait(futures, size)
        except BaseException:  # a signal (RewardInterrupted, KeyboardInterrupt): no worker may go on
            self.close(kill=True)
            raise
        results = []
        for f, chunk in zip(futures, chunks):
            if f.done() and not f.cancelled() and f.exception() is None:
                results.extend(f.result())
            else:  # a worker stuck past the time-out (in C code the alarm cannot interrupt) was killed
                why = (f"did not finish within {self.timeout_s:g} s per row (reward.timeout_s); its worker was stopped"
                       if not f.done() or f.cancelled() else f"its worker process failed: {f.exception()!r}")
                results.extend(("error", why, "") for _ in chunk)
        if not all(f.done() and not f.cancelled() and f.exception() is None for f in futures):
            self.close(kill=True)
        return results

    def _wait(self, futures: list, chunk_size: int) -> None:
        """Until every chunk is done, or none finished for a whole chunk's time-out (plus a margin)."""
        window = None if self.timeout_s is None else self.timeout_s * chunk_size + 5.0
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=window, return_when=FIRST_COMPLETED)
            if not done:
                return

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        jobs, mask = self._jobs(batch)
        with _scoring():
            results = self._run(jobs)
        n = len(jobs)
        scores = torch.zeros(n, dtype=torch.float64)
        errors = np.zeros(n, dtype=np.float64)
        dict_rows: list[dict] = [{} for _ in range(n)]
        for (i, data_source, _, _, extra_info), res in zip(jobs, results):
            if res[0] == "ok" and not is_finite_number(res[1]["score"] if isinstance(res[1], dict) and "score" in res[1]
                                                       else res[1]):
                res = ("error", f"the reward function returned {res[1]!r} (not a finite number)", "")
            if res[0] == "error":
                if self.on_error == "raise":
                    raise RewardError(
                        f"reward function {_function_name(self.compute_score)} failed on "
                        f"{_row_name(i, data_source, extra_info)}: {res[1]}"
                        f"{_where(res[2])}; reward.on_error=zero scores such rows 0 and counts them"
                    )
                errors[i] = 1.0
                if self.record_acc:
                    dict_rows[i] = {"acc": 0.0}  # its score; a nan here would read as a non-finite step
                continue
            value = res[1]
            if isinstance(value, dict):
                if "score" not in value:
                    raise RewardError(
                        f"row {i} (data_source={data_source!r}): the reward dict has no 'score' key: {sorted(value)}"
                    )
                dict_rows[i] = value
                value = value["score"]
            if not isinstance(value, (numbers.Real, np.number)) and not (
                isinstance(value, torch.Tensor) and value.numel() == 1
            ):
                raise RewardError(
                    f"row {i} (data_source={data_source!r}): the reward function returned {type(value).__name__}, "
                    "expected a float or a dict with 'score'"
                )
            scores[i] = float(value)
            if self.record_acc and not dict_rows[i]:
                dict_rows[i] = {"acc": scores[i].item()}
        extra = _stack_extra(dict_rows, n)
        extra[ERRORS_KEY] = errors
        if self.overlong is not None:
            scores += self._overlong_penalties(mask, extra)
        return place_on_last_token(scores, mask), extra

    def _overlong_penalties(self, mask: torch.Tensor, extra: dict[str, np.ndarray]) -> torch.Tensor:
        """The overlong penalties ``[N]``; with ``overlong.log`` also recorded in ``extra``."""
        penalty = overlong_penalty(mask.sum(-1).cpu(), self.overlong)
        if self.overlong.log:
            extra["overlong_reward"] = penalty.numpy().copy()
            extra["overlong"] = (penalty < 0).to(torch.float64).numpy()
        return penalty

    def close(self, kill: bool = False) -> None:
        """Shut down the worker pool (if any); ``kill`` ends its processes at once (a stuck scorer)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if kill:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                if proc.is_alive():
                    proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
        else:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class BatchRewardFn:
    """Wraps ``fn(batch) -> tensor [N]`` (or ``(tensor [N], extra dict)``) so it is called like a
    :class:`RewardManager`: returns ``(token_level_scores [N, R], extra)`` with each score on the
    row's last valid response token."""

    def __init__(self, fn: Callable[[Batch], Any]):
        self.fn = fn

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        with _scoring():
            try:
                out = self.fn(batch)
            except SystemExit as err:  # its exit code would pass for the trainer's own (3: non-finite losses)
                raise RewardError(f"batch reward function {_function_name(self.fn)} failed on a batch of "
                                  f"{len(batch)} rows: {exit_message(err)}") from err
        extra: dict[str, np.ndarray] = {}
        if isinstance(out, tuple):
            out, extra = out
        scores = torch.as_tensor(out, dtype=torch.float32)
        name = getattr(self.fn, "__name__", repr(self.fn))
        if scores.shape != (len(batch),):
            shape = list(scores.shape)
            raise ValueError(f"batch reward function {name} returned shape {shape}, expected [{len(batch)}]")
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            sources = batch.non_tensor_batch.get("data_source")
            extras = batch.non_tensor_batch.get("extra_info")
            rows = [_row_name(i, sources[i] if sources is not None else None, extras[i] if extras is not None else None)
                    + f" = {scores[i].item()}" for i in bad[:5]]
            raise RewardError(f"batch reward function {name} returned a non-finite reward on {len(bad)} of "
                              f"{len(batch)} rows: " + "; ".join(rows))
        return place_on_last_token(scores, response_mask_of(batch)), dict(extra)
