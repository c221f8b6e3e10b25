"""The rollout-engine interface, sampling parameters, and what every engine shares: the output batch
(`assemble_rollout_batch`) and the prompts' uids (`with_uids`). Engines are chosen by name in
`posttrain.rollout.engines`.

An engine turns a prompt batch into a response batch::

    out = engine.generate(prompts, sampling)      # Batch [N] -> Batch [N * sampling.n]
    engine.update_weights(model_or_state_dict)    # after each actor update (no-op when shared)

Prompt batch (``P`` = padded prompt length): ``input_ids``, ``attention_mask``, ``position_ids``
``[N, P]``, left-padded, plus any non-tensor keys (``uid``, ``data_source``, ``reward_model``...).

Output batch (``R`` = ``sampling.response_length``), rows repeat-interleaved (``n`` consecutive
rows per prompt, every non-tensor key repeated with them):
``prompts [N*n, P]``, ``responses [N*n, R]`` (right-padded with pad), ``response_mask [N*n, R]``
(1 up to and including the first EOS), ``input_ids/attention_mask/position_ids [N*n, P+R]`` and,
when ``sampling.calculate_log_probs``, ``rollout_log_probs [N*n, R]``.

uids: the trainer assigns a ``uid`` per prompt before generation (verl's convention); the ``n``
samples of a prompt keep its uid. When the prompt batch has no ``uid`` the engine assigns a fresh
``uuid4`` per prompt before repeating, so GRPO groups are always defined.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from posttrain.batch import Batch

__all__ = ["SamplingParams", "RolloutEngine", "get_rollout_engine", "ROLLOUT_ENGINES", "SGLANG_MISSING"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; ``from_rollout_config`` reads verl's ``actor_rollout_ref.rollout`` keys."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 or ``do_sample=False`` means greedy."""
    top_p: float = 1.0
    """Nucleus threshold (1: off)."""
    top_k: int = -1
    """Top-k cut-off (-1 or 0: off)."""
    do_sample: bool = True
    """Sample (true) or decode greedily (false)."""
    response_length: int = 512
    """Most new tokens per response (R)."""
    calculate_log_probs: bool = True
    """Return ``rollout_log_probs``: log-softmax(logits / temperature) at the sampled tokens."""

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature <= 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported log-probs use: the sampling one, 1.0 when greedy."""
        return 1.0 if self.greedy else float(self.temperature)

    @classmethod
    def from_rollout_config(cls, rollout: Any, validate: bool = False) -> "SamplingParams":
        """Training sampling from ``rollout.*``; with ``validate`` the ``rollout.val_kwargs.*`` ones."""
        src = rollout.val_kwargs if validate else rollout
        do_sample = bool(src.do_sample) and src.temperature > 0
        return cls(
            n=int(src.n) if not validate or do_sample else 1,
            temperature=float(src.temperature) if do_sample else 0.0,
            top_p=float(src.top_p) if do_sample else 1.0,
            top_k=int(src.top_k) if do_sample else -1,
            do_sample=do_sample,
            response_length=int(rollout.response_length),
            calculate_log_probs=bool(rollout.calculate_log_probs),
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine."""

    def generate(self, prompts: Any, sampling: SamplingParams) -> Any:
        """Batch of ``N`` left-padded prompts -> Batch of ``N * sampling.n`` rows (module docstring)."""
        ...

    def update_weights(self, weights: Any) -> None:
        """Load new policy weights (a state dict or a module); a no-op for a shared module."""
        ...


# An engine with ``keeps_own_weights = True`` (vllm) holds a copy of the policy: the actor pushes its
# weights with ``update_weights(module)`` before generating whenever they changed since the last push,
# and records the pushed version in the engine's ``weights_version`` attribute.


def assemble_rollout_batch(rows: Batch, responses: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor | None,
                           pad_token_id: int) -> Batch:
    """The output Batch of every engine (keys in ``posttrain.rollout.base``) from prompt rows ``[N, P]``,
    generated ``responses`` ``[N, R]``, their ``mask`` ``[N, R]`` and log-probs (or None): tokens
    outside the mask become ``pad_token_id``, log-probs 0; response positions continue the prompt's."""
    prompt_ids, prompt_mask = rows["input_ids"], rows["attention_mask"]
    dev = prompt_ids.device
    responses = responses.masked_fill(mask == 0, pad_token_id)
    prompt_pos = rows["position_ids"] if "position_ids" in rows else prompt_positions(prompt_mask)
    resp_pos = prompt_pos[:, -1:] + torch.arange(1, responses.shape[1] + 1, device=dev)  # continue after the prompt (verl)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1),
        "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
    }
    if log_probs is not None:
        tensors["rollout_log_probs"] = log_probs * mask
    return Batch.from_dict(tensors, dict(rows.non_tensor_batch), dict(rows.meta_info))


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``clip(cumsum(mask) - 1, 0)``: position ids of a left-padded prompt ``[N, P]``."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def with_uids(prompts: Batch) -> Batch:
    """The prompts with a ``uid`` per row (kept when present, fresh uuid4 strings otherwise)."""
    if "uid" in prompts.non_tensor_batch:
        return prompts
    out = Batch(prompts.batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info))
    out.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
    return out
