"""The teacher role of on-policy distillation (``distillation.enabled``): frozen models that score the
student's sampled tokens, built once like the reference and placed like it (bf16 where the run computes in
bf16, paged to a file between passes on a CPU run, FSDP2-sharded on ranks).

Shapes: ``N`` responses, ``R`` response length, ``K`` = ``distillation.distillation_loss.topk``.

``compute_teacher_log_prob(batch) -> (teacher_log_probs [N, R], teacher_topk_ids [N, R, K] or None,
teacher_topk_log_probs [N, R, K] or None)``: the teacher's log-probs of the sampled tokens (always: the
reverse-KL metrics and the estimator losses read them), and for a top-k loss mode its ``K`` most likely
tokens at every response position with their log-probs. Always at temperature 1, as verl's teacher
(a forward pass samples nothing). Several teachers: each row goes to the teacher whose key is the row's
``teacher_key`` value; every teacher runs on every rank, with no rows if need be (each forward of a sharded
model is a collective).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from posttrain.batch import Batch
from posttrain.models import autocast_context, compute_response_logprobs
from posttrain.models.microbatch import is_sharded
from posttrain.models.topk_logprobs import compute_response_topk
from posttrain.workers.prepare import OnDevice

__all__ = ["TeacherScores", "TeacherWorker", "Teachers", "route_rows"]

TeacherScores = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class TeacherWorker:
    """One frozen teacher.

    Args:
        module: the teacher model, placed (`posttrain.workers.build` prepares it), frozen here.
        ref_config: ``actor_rollout_ref.ref`` (the log-prob micro-batches the teacher's passes use too).
        topk: ``K`` for a top-k loss mode, None for the estimator modes (the sampled tokens' log-probs only).
        remove_padding: padding-free forward (``actor_rollout_ref.model.use_remove_padding``).
        param_dtype: the precision `posttrain.workers.build` decided (``bf16`` / ``fp32``).
    """

    def __init__(self, module: nn.Module, ref_config: Any, *, topk: int | None, device: str | torch.device = "cpu",
                 param_dtype: str = "fp32", remove_padding: bool = False):
        self.config, self.topk, self.remove_padding = ref_config, topk, remove_padding
        self.device = torch.device(device)
        self.module = module.to(self.device).eval().requires_grad_(False)
        self.param_dtype = param_dtype
        self.autocast = functools.partial(autocast_context, self.device, param_dtype)

    def score(self, batch: Any) -> TeacherScores:
        """``(log-probs [N, R], top-k ids [N, R, K] or None, top-k log-probs or None)`` of ``batch['responses']``."""
        cfg = self.config
        shared = bool(cfg.use_prefix_grouper)
        options = dict(use_dynamic_bsz=bool(cfg.log_prob_use_dynamic_bsz), max_token_len=cfg.log_prob_max_token_len_per_gpu,
                       autocast=self.autocast, remove_padding=self.remove_padding, shared_prefix=shared)
        n, resp_len = batch["responses"].shape
        if n == 0 and not is_sharded(self.module):  # no rows for this teacher, and nobody to keep in step with
            empty = batch["responses"].new_zeros((0, resp_len), dtype=torch.float32)
            k = self.topk or 0
            return empty, (empty.new_zeros((0, resp_len, k), dtype=torch.long) if self.topk else None), (
                empty.new_zeros((0, resp_len, k)) if self.topk else None)
        if self.topk is None:
            log_probs, _ = compute_response_logprobs(self.module, batch, cfg.log_prob_micro_batch_size_per_gpu, 1.0,
                                                     False, **options)
            return log_probs, None, None
        out = compute_response_topk(self.module, batch, self.topk, cfg.log_prob_micro_batch_size_per_gpu, **options)
        return out.log_probs, out.topk_ids, out.topk_log_probs


def route_rows(keys: Any, teachers: list[str]) -> dict[str, torch.Tensor]:
    """{teacher key: the row indices it scores} from each row's ``teacher_key`` value; one teacher takes every
    row. Raises ValueError naming the first row whose value names no teacher."""
    n = len(keys)
    if len(teachers) == 1:
        return {teachers[0]: torch.arange(n)}
    values = [str(v.item() if hasattr(v, "item") else v) for v in keys]
    for i, value in enumerate(values):
        if value not in teachers:
            raise ValueError(f"row {i}: its distillation.teacher_key value {value!r} names no teacher "
                             f"(teachers: {', '.join(sorted(teachers))})")
    return {t: torch.tensor([i for i, v in enumerate(values) if v == t], dtype=torch.long) for t in teachers}


class Teachers:
    """Every teacher of a run by routing key (`posttrain.config.distillation.resolve_teachers`), and the call
    that scores a batch with them.

    The worker group's residency reads ``module``: the teacher's own when there is one (paged in and out
    around the call, like the reference); with several, each teacher's pass runs inside ``one_pass(module)``,
    the placement's (`posttrain.workers.prepare.Placement.one_pass`: a teacher paged to a file is in memory
    for its own pass only).
    """

    def __init__(self, teachers: dict[str, TeacherWorker], teacher_key: str,
                 one_pass: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None):
        if not teachers:
            raise ValueError("Teachers needs at least one teacher")
        self.teachers, self.teacher_key = dict(teachers), teacher_key
        self.one_pass = one_pass or OnDevice.one_pass  # placed by no one: nothing is paged

    @property
    def module(self) -> nn.Module | None:
        return next(iter(self.teachers.values())).module if len(self.teachers) == 1 else None

    @property
    def topk(self) -> int | None:
        return next(iter(self.teachers.values())).topk

    def compute_teacher_log_prob(self, batch: Batch) -> TeacherScores:
        """Each row scored by its teacher (`route_rows`), results in the batch's row order."""
        keys = (batch.non_tensor_batch.get(self.teacher_key) if len(self.teachers) > 1
                else np.zeros(len(batch), dtype=object))
        if keys is None:
            raise KeyError(f"distillation.teacher_key={self.teacher_key!r}: the batch has no such column "
                           f"(columns: {', '.join(sorted(batch.non_tensor_batch))})")
        rows = route_rows(keys, list(self.teachers))
        n, resp_len = batch["responses"].shape
        log_probs = torch.zeros(n, resp_len, dtype=torch.float32)
        k = self.topk
        top_ids = torch.zeros(n, resp_len, k, dtype=torch.long) if k else None
        top_lps = torch.zeros(n, resp_len, k, dtype=torch.float32) if k else None
        tensors = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")}
        for key, teacher in self.teachers.items():  # every teacher, in one order on every rank
            idx = rows[key]
            part = {name: value[idx.to(value.device)] for name, value in tensors.items()}
            with self.one_pass(teacher.module) if len(self.teachers) > 1 else contextlib.nullcontext():
                lp, ids, lps = teacher.score(part)
            log_probs[idx] = lp.cpu()
            if k:
                top_ids[idx], top_lps[idx] = ids.cpu(), lps.cpu()
        return log_probs, top_ids, top_lps
