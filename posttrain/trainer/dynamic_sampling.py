"""DAPO's dynamic sampling (`algorithm.filter_groups`): a training step keeps only the prompt groups
whose responses differ in `filter_groups.metric`, and generates more prompt batches until it holds
`data.train_batch_size` such groups.

Follows verl's DAPO trainer (`recipe/dapo/dapo_ray_trainer.py`, `RayDAPOTrainer.fit`):

- a group (the responses sharing a `uid`) is kept when the population std of its metric values is
  > 0, or when it holds a single response (rollout.n=1: nothing can be compared, so nothing is
  dropped);
- each round draws `data.gen_batch_size` prompts from the train loader, generates and scores them,
  and appends its kept groups in order; once at least `train_batch_size` groups are kept the batch
  is cut to exactly `train_batch_size * n` responses (the surplus groups of the last round are
  discarded, as verl discards them);
- `max_num_gen_batches` > 0 bounds the rounds of one step: when that many rounds kept too few groups
  the run stops with an error (verl raises ValueError there); 0 means no bound in verl. Here 0 still
  ends: a step that has drawn a whole epoch of prompts and still holds too few groups stops the run
  with `DynamicSamplingStalled` (exit code 1), since more rounds would only repeat the same prompts
  (a reward that never varies within a group would otherwise loop forever in silence);
- every round prints one line: the groups kept so far and the groups needed.

The loader is the trainer's own, so its saved position after a step counts every batch the step
drew, and a resumed run draws the same batches as an uninterrupted one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from posttrain.batch import Batch
from posttrain.errors import PosttrainError

__all__ = ["DynamicSampling", "DynamicSamplingStalled", "EpochsExhausted", "GenerationLimitError", "concat_rounds",
           "kept_group_rows", "metric_values"]

# Batch keys whose columns start with the prompt (left-padded, so a wider prompt pads on the left).
_PROMPT_KEYS = {"prompts": "pad", "input_ids": "pad", "attention_mask": 0, "position_ids": 0}


class GenerationLimitError(PosttrainError, RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` rounds kept fewer than `data.train_batch_size` groups
    (exit code 1, a user error found while running)."""


class DynamicSamplingStalled(GenerationLimitError):
    """With `max_num_gen_batches=0` (no limit of rounds), one step drew a whole epoch of prompts and still
    kept fewer than `data.train_batch_size` groups: more rounds would only repeat the same prompts, so
    the run stops (exit code 1) instead of generating forever."""


class EpochsExhausted(Exception):
    """The run's `trainer.total_epochs` passes over the prompts are used up in the middle of a step
    (dynamic sampling draws more than one batch per step): the run ends at the last finished step,
    as verl's DAPO loop ends with its data loader."""


def metric_values(batch: Batch, extra: dict[str, np.ndarray], metric: str) -> np.ndarray:
    """``[N]`` float64 values compared within each group.

    seq_reward: the response's summed ``token_level_scores`` (the overlong penalty included).
    seq_final_reward: verl sums ``token_level_rewards``; posttrain filters before any in-reward KL
    exists (that combination is refused at start-up), so the two are the same sum.
    acc, score, or any other name: that field of the reward manager's extra output.
    """
    if metric in ("seq_reward", "seq_final_reward"):
        return batch["token_level_scores"].sum(-1).to(torch.float64).cpu().numpy()
    if metric not in extra:
        fields = sorted(k for k in extra if not k.startswith("reward/"))
        raise PosttrainError(
            f"algorithm.filter_groups.metric={metric}: the reward has no {metric!r} field (its fields: {fields or 'none'}); "
            "return a dict with it from the reward function, set reward_model.reward_manager=dapo (records a "
            "plain-number score as acc), or use metric=seq_reward")
    return np.asarray(extra[metric], dtype=np.float64)


def kept_group_rows(uids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(rows of the kept groups in batch order, groups kept, groups dropped).

    A group is kept when its values' population std is > 0 or it has one response (verl). A nan
    value makes the std nan, which is not > 0: the group is dropped.
    """
    groups: dict[object, list[float]] = defaultdict(list)
    for uid, value in zip(uids, values):
        groups[uid].append(value)
    kept = {uid for uid, vals in groups.items() if len(vals) == 1 or np.std(vals) > 0}
    rows = np.array([i for i, uid in enumerate(uids) if uid in kept], dtype=np.int64)
    return rows, len(kept), len(groups) - len(kept)


def concat_rounds(batches: list[Batch], pad_token_id: int) -> Batch:
    """Rows of all rounds in order. Each round's prompts were padded to its own longest prompt, so
    narrower rounds are left-padded to the widest first (pad tokens, mask 0, position 0)."""
    width = max(b["prompts"].shape[1] for b in batches)
    return Batch.concat([_left_pad_prompts(b, width, pad_token_id) for b in batches])


def _left_pad_prompts(batch: Batch, width: int, pad_token_id: int) -> Batch:
    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    for key, fill in _PROMPT_KEYS.items():
        if key in batch.batch.keys():
            t = batch[key]
            pad = torch.full((t.shape[0], extra), pad_token_id if fill == "pad" else fill, dtype=t.dtype, device=t.device)
            batch.batch[key] = torch.cat([pad, t], dim=1)
    return batch


@dataclass
class DynamicSampling:
    """One step's group filtering (see the module docstring).

    Args:
        metric: `algorithm.filter_groups.metric`.
        train_batch_size: groups a training batch holds (`data.train_batch_size`).
        n: responses per group (`actor_rollout_ref.rollout.n`).
        max_rounds: `algorithm.filter_groups.max_num_gen_batches` (0: no bound of rounds).
        pad_token_id: pads prompts when rounds of different prompt widths are joined.
        epoch_prompts: prompts the train loader gives per epoch; with ``max_rounds=0`` a step that has
            drawn this many without filling its batch stops (`DynamicSamplingStalled`). 0: no bound.
        step: the training step, for the log lines and messages.
        log: where the one line per round goes.
    """

    metric: str
    train_batch_size: int
    n: int
    max_rounds: int
    pad_token_id: int
    epoch_prompts: int = 0
    step: int = 0
    log: Callable[[str], None] = field(default=lambda line: print(line, flush=True))

    def collect(self, prompts: Batch, draw: Callable[[], Batch],
                generate_and_score: Callable[[Batch, int], tuple[Batch, dict]]) -> tuple[Batch, dict, dict]:
        """(training batch of exactly ``train_batch_size * n`` rows, the reward's extra output over every
        response generated in the step, metrics).

        ``generate_and_score(prompts, first_uid)`` generates and scores one round, numbering its
        prompts from ``first_uid`` (uids stay unique across the rounds of a step); ``draw()`` gives
        the next prompt batch.
        """
        kept, extras, sizes, seen = [], [], [], set()
        groups_kept = groups_dropped = rounds = drawn = 0
        while True:
            rounds += 1
            batch, extra = generate_and_score(prompts, drawn)
            drawn += len(prompts)
            extras.append(extra)
            sizes.append(len(batch))
            values = metric_values(batch, extra, self.metric)
            if len(seen) < 8:  # a few of the values seen, for the message when nothing varies
                seen.update(np.unique(values).tolist()[:8])
            rows, k, d = kept_group_rows(batch.non_tensor_batch["uid"], values)
            groups_kept, groups_dropped = groups_kept + k, groups_dropped + d
            if len(rows):
                kept.append(batch.index_select(rows))
            full = groups_kept >= self.train_batch_size
            self.log(self._round_line(rounds, groups_kept, groups_dropped, drawn, full))
            if full:
                break
            if self.max_rounds > 0 and rounds >= self.max_rounds:
                raise GenerationLimitError(self._limit_message(rounds, groups_kept, drawn))
            if self.max_rounds == 0 and 0 < self.epoch_prompts <= drawn:
                raise DynamicSamplingStalled(self._stalled_message(rounds, groups_kept, drawn, seen))
            prompts = draw()
        training = concat_rounds(kept, self.pad_token_id).slice(0, self.train_batch_size * self.n)
        metrics = {"train/num_gen_batches": float(rounds), "train/num_groups_kept": float(groups_kept),
                   "train/num_groups_dropped": float(groups_dropped)}
        return training, _concat_extra(extras, sizes), metrics

    def _round_line(self, rounds: int, groups_kept: int, groups_dropped: int, drawn: int, full: bool) -> str:
        where = f"step {self.step} " if self.step else ""
        then = "the batch is full" if full else "drawing more prompts"
        return (f"dynamic sampling: {where}round {rounds}: {min(groups_kept, self.train_batch_size)}/"
                f"{self.train_batch_size} groups kept so far ({drawn} prompts drawn, {groups_dropped} groups dropped "
                f"with equal {self.metric}); {then}")

    def _stalled_message(self, rounds: int, groups_kept: int, drawn: int, seen: set) -> str:
        values = ", ".join(f"{v:g}" for v in sorted(seen, key=lambda v: (v != v, v))[:8])  # nan last
        where = f"step {self.step}: " if self.step else ""
        return (f"dynamic sampling: {where}{rounds} generation rounds drew {drawn} prompts, a whole epoch of the "
                f"{self.epoch_prompts} training prompts, and kept only {groups_kept} groups whose {self.metric} "
                f"differs, fewer than data.train_batch_size={self.train_batch_size}; the other groups' responses "
                f"all scored the same ({self.metric} values seen: {values}), so more rounds would repeat the same "
                "prompts forever (algorithm.filter_groups.max_num_gen_batches=0 sets no limit of rounds). Check that "
                "the reward function can score responses differently, use prompts the model neither always nor never "
                "solves, lower data.train_batch_size, raise actor_rollout_ref.rollout.n or "
                "actor_rollout_ref.rollout.temperature, or set algorithm.filter_groups.max_num_gen_batches=K to allow "
                "K rounds per step (more than an epoch of prompts)")

    def _limit_message(self, rounds: int, groups_kept: int, drawn: int) -> str:
        return (f"dynamic sampling: {rounds} generation rounds ({drawn} prompts) kept {groups_kept} groups whose "
                f"{self.metric} differs, fewer than data.train_batch_size={self.train_batch_size} "
                f"(algorithm.filter_groups.max_num_gen_batches={self.max_rounds}); the prompts are too easy or too "
                "hard for the model: raise max_num_gen_batches (0: no limit) or data.gen_batch_size, or use other data")


def _concat_extra(extras: list[dict[str, np.ndarray]], sizes: list[int]) -> dict[str, np.ndarray]:
    """The rounds' per-row arrays joined by key; where a round lacks a key its rows hold nan (a numeric
    key) or None."""
    out = {}
    for key in dict.fromkeys(k for e in extras for k in e):
        present = [np.asarray(e[key]) for e in extras if key in e]
        numeric = all(a.dtype != object for a in present)
        parts = [np.asarray(e[key]) if key in e else
                 (np.full(size, np.nan) if numeric else np.full(size, None, dtype=object))
                 for e, size in zip(extras, sizes)]
        out[key] = np.concatenate(parts)
    return out
