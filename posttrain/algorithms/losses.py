"""Loss aggregation, the clipped value loss and the entropy bonus (verl 0.9 semantics).

Global normalisers. By default every mode normalises by the micro-batch it sees (verl's local
behaviour). With gradient accumulation, pass the mini-batch totals instead so that the summed
micro-batch losses equal the mini-batch loss:
  * `batch_num_tokens`: valid tokens in the whole mini-batch (token-mean);
  * `global_batch_size`: non-empty sequences in the whole mini-batch (seq-mean-* modes);
  * `dp_size`: data-parallel ranks; the loss is multiplied by it because DDP/FSDP average
    gradients across ranks (the normalisers above must then be global across ranks too);
  * `loss_scale_factor`: the constant divisor of seq-mean-token-sum-norm (default: response_len).
These are verl's argument names (its `ActorConfig.global_batch_info` keys).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algorithms.logprobs import entropy_from_logits
from posttrain.algorithms.utils import clip_by_value, masked_mean, masked_sum

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a `[batch, response_len]` loss matrix to a scalar.

    token-mean               sum(loss * mask) / tokens
    token-sum                sum(loss * mask)
    seq-mean-token-sum       mean over non-empty sequences of sum_t loss
    seq-mean-token-mean      mean over non-empty sequences of mean_t loss (1e-8 in the divisor)
    seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor (Dr.GRPO,
                             https://arxiv.org/abs/2503.20783; default factor: response_len)
    Each result is multiplied by `dp_size`; see the module docstring for the normalisers.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            _require_local(dp_size, "batch_num_tokens")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # [batch]
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # empty rows do not count
        if global_batch_size is None:
            _require_local(dp_size, "global_batch_size")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        tokens = torch.sum(loss_mask, dim=-1)  # [batch]
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (tokens + 1e-8)
        seq_mask = (tokens > 0).float()
        if global_batch_size is None:
            _require_local(dp_size, "global_batch_size")
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")


def _require_local(dp_size: int, name: str) -> None:
    if dp_size > 1:
        raise ValueError(f"agg_loss: {name} (a global count) is required when dp_size > 1")


def with_loss_scale_factor(info: dict[str, Any], config: Any) -> dict[str, Any]:
    """``agg_loss``'s normalisers plus the role's ``loss_scale_factor`` (verl 0.9.1 puts it into
    ``global_batch_info`` the same way) where one is set: seq-mean-token-sum-norm's divisor."""
    factor = getattr(config, "loss_scale_factor", None)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        return info  # unset, or a section built without the loader (its default still the `${...}` it follows)
    return {**info, "loss_scale_factor": factor}


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, https://arxiv.org/abs/1707.06347, as in TRL/verl):

    0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    vpreds, returns, values, response_mask: `[batch, response_len]`.
    Returns (vf_loss scalar, vf_clipfrac scalar tensor: share of tokens where the clipped term is larger).
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        loss_mat=torch.max(unclipped, clipped),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy of `logits` `[batch, response_len, vocab]` (a scalar)."""
    return agg_loss(loss_mat=entropy_from_logits(logits), loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
