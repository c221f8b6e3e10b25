"""Log-probabilities and entropy of response tokens, without ``[batch, seq, vocab]`` float32 tensors.

Shapes: ``N`` rows, ``P`` prompt length (left-padded), ``R`` response length (right-padded),
``S = P + R``, ``H`` hidden size, ``V`` vocabulary, ``T`` valid response tokens of a micro-batch.

How one micro-batch is computed (``response_logprobs``):

1. columns that are padding in *every* row are dropped (common left padding of prompts and the
   tail after the longest response); positions are passed explicitly, so this is exact. With
   ``remove_padding`` (verl's ``use_remove_padding``) all valid tokens are packed into one row
   instead (no padding at all; with SDPA the block-diagonal mask is dense, ``T_total^2``); with
   ``shared_prefix`` (verl's ``use_prefix_grouper``) rows that share a prompt become one row that
   encodes the prompt once (`posttrain.models.shared_prefix`);
2. the backbone (``model.model`` for Llama) runs once -> hidden ``[B, S', H]``;
3. only hidden states that *predict a valid response token* are kept -> ``[T, H]`` (the state at
   column ``P - 1 + j`` predicts response token ``j``; tokens after EOS are skipped);
4. ``lm_head`` + log-softmax run over chunks of those ``T`` rows: each chunk's logits ``[t, V]``
   are upcast to float32, divided by the temperature (as verl does), and reduced to a log-prob and
   an entropy per token (`posttrain.algorithms.logprobs.logprob_and_entropy`, the one copy of that
   math; `posttrain.models.lean.head.head_logprobs`). With gradients on, the head keeps little for
   backward (bf16 logits or none, no float32 ``[t, V]`` gradient): that room's docstring says how.

Positions that are not valid response tokens get log-prob 0 and entropy 0.

``calculate_sum_pi_squared`` (the old-log-prob pass of ``actor.calculate_sum_pi_squared``, no gradient)
also returns each token's ``sum_v pi_v^2`` from the same chunks' softmax (a third ``[B, R]`` tensor).

Under FSDP2 (``posttrain.distributed.fsdp.shard_model``) the backbone and ``lm_head`` calls run
inside the root unit's forward hooks (:func:`call_as_forward`), and ``compute_response_logprobs``
runs the same number of micro-batches on every rank (``equal_micro_batch_count``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from posttrain.algorithms.logprobs import logprob_and_entropy, logprob_entropy_sum_pi_squared
from posttrain.models.attention import fast_cpu_attention
from posttrain.models.compile import compiled_layers
from posttrain.models.lean.head import head_logprobs
from posttrain.models.microbatch import equal_micro_batch_count, forward_micro_batches, is_sharded
from posttrain.models.shared_prefix import prompt_key, shared_prefix_hidden_states, take_columns

__all__ = ["FSDP_CALL_ATTR", "call_as_forward", "compute_response_logprobs", "forget_forward_record",
           "response_logprobs", "response_hidden_states", "split_lm"]

FSDP_CALL_ATTR = "posttrain_fsdp_call"
"""Name of the FSDP forward method ``shard_model`` registers on a sharded root: ``root.<name>(fn, *args)``."""


def call_as_forward(model: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run as ``model``'s forward when ``model`` is an FSDP-sharded root.

    Calling ``model.base_model`` and ``lm_head`` directly skips the root's forward hooks, which
    gather the parameters the root unit owns (final norm, tied embedding) and prepare backward.
    For any other model this is a plain call.
    """
    runner = getattr(model, FSDP_CALL_ATTR, None)
    return runner(fn, *args, **kwargs) if runner is not None else fn(*args, **kwargs)

def split_lm(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None] | None:
    """``(backbone, lm_head, final_logit_softcapping)`` of a HF causal LM, or None if not split-able."""
    body = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if body is None or body is model or head is None:
        return None
    return body, head, getattr(model.config, "final_logit_softcapping", None)


def _column_window(attention_mask: torch.Tensor, response_length: int) -> tuple[int, int, int]:
    """``(lo, hi, take)``: run columns ``[lo, hi)``; ``take`` response positions are scored."""
    seq_len = attention_mask.shape[1]
    prompt_len = seq_len - response_length
    used = attention_mask.bool().any(0).nonzero().flatten()
    lo = int(used[0]) if used.numel() else prompt_len - 1
    last = int(used[-1]) + 1 if used.numel() else prompt_len
    take = max(1, min(response_length, last - prompt_len))
    lo = min(lo, prompt_len - 1)
    return lo, prompt_len - 1 + take, take


def _packed_hidden_states(backbone, input_ids, attention_mask, position_ids, response_length):
    """Padding-free forward: all valid tokens in one row, sequences told apart by positions restarting
    at 0 (transformers builds a block-diagonal causal mask when ``attention_mask`` is None)."""
    keep = attention_mask.bool()
    first = keep.long().argmax(-1, keepdim=True)
    if bool((position_ids.gather(1, first) != 0).any()):
        raise ValueError("use_remove_padding needs position_ids = clip(cumsum(attention_mask) - 1, 0)")
    out = backbone(input_ids=input_ids[keep][None], position_ids=position_ids[keep][None],
                   attention_mask=None, use_cache=False)
    flat = out.last_hidden_state[0]  # [T_total, H]
    flat_index = keep.flatten().long().cumsum(0).view_as(keep) - 1  # [B, S] row/col -> packed index
    seq_len = keep.shape[1]
    cols = flat_index[:, seq_len - response_length - 1:seq_len - 1].clamp(min=0)  # [B, R]
    return take_columns(flat, cols), response_length  # positions after EOS hold unrelated states; callers mask them


def response_hidden_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    remove_padding: bool = False,
    shared_prefix: bool = False,
) -> tuple[torch.Tensor, int]:
    """Hidden states that predict response tokens: ``([B, take, H], take)`` with ``take <= R``.

    ``hidden[:, j]`` is the backbone output at column ``P - 1 + j`` (it predicts response token ``j``).
    ``remove_padding`` packs the valid tokens of all rows into one sequence (verl's
    ``use_remove_padding``); ``shared_prefix`` encodes each distinct prompt once for all its
    responses (verl's ``use_prefix_grouper``, `posttrain.models.shared_prefix`) when that computes
    less; otherwise only columns that are padding in every row are dropped.
    """
    if remove_padding and shared_prefix:
        raise ValueError("use_remove_padding and use_prefix_grouper are two different layouts; set one of them")
    with fast_cpu_attention(backbone):
        if remove_padding:
            return _packed_hidden_states(backbone, input_ids, attention_mask, position_ids, response_length)
        lo, hi, take = _column_window(attention_mask, response_length)
        if shared_prefix:  # the window up to the last scored token: its responses are `take` long
            end = hi + 1
            hidden = shared_prefix_hidden_states(backbone, input_ids[:, lo:end], attention_mask[:, lo:end],
                                                 position_ids[:, lo:end], take)
            if hidden is not None:
                return hidden, take
        out = backbone(
            input_ids=input_ids[:, lo:hi],
            attention_mask=attention_mask[:, lo:hi],
            position_ids=position_ids[:, lo:hi],
            use_cache=False,
        )
    return out.last_hidden_state[:, -take:], take


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    entropy_grad: bool = True,
    remove_padding: bool = False,
    shared_prefix: bool = False,
    calculate_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One micro-batch: log-probs (and entropy) of ``responses`` ``[B, R]`` under ``model``.

    input_ids/attention_mask/position_ids: ``[B, P+R]``. Differentiable when grad is enabled
    (``entropy_grad=False`` computes the entropy without a graph). Returns float32 ``[B, R]``
    tensors; positions masked in ``attention_mask[:, P:]`` are 0. ``remove_padding``,
    ``shared_prefix``: see :func:`response_hidden_states`. ``calculate_sum_pi_squared`` (no gradient):
    a third tensor, each token's ``sum_v pi_v^2``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    return call_as_forward(model, _response_logprobs, model, input_ids, attention_mask, position_ids, responses,
                           temperature, calculate_entropy, entropy_grad, remove_padding, shared_prefix,
                           calculate_sum_pi_squared)


def _response_logprobs(model, input_ids, attention_mask, position_ids, responses, temperature,
                       calculate_entropy, entropy_grad, remove_padding, shared_prefix, sum_pi_squared=False):
    batch, resp_len = responses.shape
    parts = split_lm(model)
    if parts is None:
        return _full_logits_logprobs(model, input_ids, attention_mask, position_ids, responses,
                                     temperature, calculate_entropy, sum_pi_squared)
    backbone, head, softcap = parts
    with compiled_layers(model):  # compile_layers=True: the decoder layers through torch.compile
        hidden, take = response_hidden_states(backbone, input_ids, attention_mask, position_ids, resp_len,
                                              remove_padding, shared_prefix)
    valid = attention_mask[:, -resp_len:][:, :take].bool()  # [B, take]
    labels = responses[:, :take][valid]  # [T]
    lp_flat, ent_flat, *sum_pi2_flat = head_logprobs(hidden[valid], labels, head, temperature, softcap,
                                                      calculate_entropy, entropy_grad, sum_pi_squared)
    full_valid = torch.zeros(batch, resp_len, dtype=torch.bool, device=responses.device)
    full_valid[:, :take] = valid
    at = full_valid.nonzero(as_tuple=True)
    log_probs = torch.zeros(batch, resp_len, dtype=torch.float32, device=responses.device)
    log_probs = log_probs.index_put(at, lp_flat)
    entropy = torch.zeros_like(log_probs).index_put(at, ent_flat) if calculate_entropy else None
    if sum_pi_squared:
        return log_probs, entropy, torch.zeros_like(log_probs).index_put(at, sum_pi2_flat[0])
    return log_probs, entropy


def _full_logits_logprobs(model, input_ids, attention_mask, position_ids, responses, temperature, calc_entropy,
                          sum_pi_squared=False):
    """Fallback for models without a separate backbone/lm_head: slice ``[B, R, V]`` logits."""
    resp_len = responses.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, -resp_len - 1:-1].float() / temperature
    mask = attention_mask[:, -resp_len:].to(torch.float32)
    vocab = logits.shape[-1]
    if sum_pi_squared:
        lp, ent, sum_pi2 = logprob_entropy_sum_pi_squared(logits.reshape(-1, vocab), responses.reshape(-1),
                                                          calc_entropy)
        ent = ent.view_as(mask) * mask if calc_entropy else None
        return lp.view_as(mask) * mask, ent, sum_pi2.view_as(mask) * mask
    lp, ent = logprob_and_entropy(logits.reshape(-1, vocab), responses.reshape(-1), calc_entropy)
    lp = lp.view_as(mask) * mask
    return lp, (ent.view_as(mask) * mask if calc_entropy else None)


def _tensors(data: Any) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    return {k: data[k] for k in keys}


def compute_response_logprobs(
    model: nn.Module,
    data: Any,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    *,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
    autocast: Any = None,
    remove_padding: bool = False,
    shared_prefix: bool = False,
    calculate_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-probs ``[N, R]`` (and entropy ``[N, R]`` or None) of ``data['responses']`` under ``model``;
    with ``calculate_sum_pi_squared`` a third ``[N, R]`` tensor, each token's ``sum_v pi_v^2``.

    data: a ``Batch`` or mapping with ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P+R]``
    and ``responses`` ``[N, R]``. Runs in micro-batches of ``micro_batch_size`` rows (or by
    ``max_token_len`` tokens with ``use_dynamic_bsz``), padding-free with ``remove_padding``, each
    distinct prompt encoded once with ``shared_prefix`` (its rows kept in one micro-batch), inside
    the ``autocast`` context-manager factory when given, without gradients. Logits are divided by
    ``temperature``. Results are on ``data``'s device.
    """
    tensors = _tensors(data)
    device = next(model.parameters()).device
    n, resp_len = tensors["responses"].shape
    prompts = prompt_key(tensors["input_ids"], tensors["attention_mask"], resp_len) if shared_prefix else None
    groups = forward_micro_batches(tensors["attention_mask"], micro_batch_size, use_dynamic_bsz, max_token_len, prompts)
    # under FSDP each forward is a collective: every rank runs the same number (padding ones are dropped)
    plan = equal_micro_batch_count(groups) if is_sharded(model) else [(g, False) for g in groups]
    out_device = tensors["responses"].device
    log_probs = torch.zeros(n, resp_len, dtype=torch.float32, device=out_device)
    entropy = torch.zeros_like(log_probs) if calculate_entropy else None
    sum_pi_squared = torch.zeros_like(log_probs) if calculate_sum_pi_squared else None
    # one autocast region for all micro-batches: autocast caches the bf16 casts of the weights
    ctx = autocast() if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for idx, padding in plan:
            mb = _stand_in_row(tensors) if not idx.numel() else {k: v[idx.to(v.device)] for k, v in tensors.items()}
            mb = {k: v.to(device) for k, v in mb.items()}
            lp, ent, *sum_pi2 = response_logprobs(model, **mb, temperature=temperature,
                                                  calculate_entropy=calculate_entropy, remove_padding=remove_padding,
                                                  shared_prefix=shared_prefix,
                                                  calculate_sum_pi_squared=calculate_sum_pi_squared)
            if padding:
                continue
            log_probs[idx.to(out_device)] = lp.to(out_device)
            if entropy is not None:
                entropy[idx.to(out_device)] = ent.to(out_device)
            if sum_pi_squared is not None:
                sum_pi_squared[idx.to(out_device)] = sum_pi2[0].to(out_device)
    forget_forward_record(model)
    return (log_probs, entropy) if sum_pi_squared is None else (log_probs, entropy, sum_pi_squared)


def forget_forward_record(model: nn.Module) -> None:
    """Clear FSDP2's record of the forwards just run (kept for backward prefetching).

    FSDP2 appends every forward to a list that only a backward clears; a forward-only model (the
    reference) would grow it for the whole run. ``reset_iter_state`` clears it and reshards (no
    collectives); skipped inside ``gathered_for_generation``, which keeps parameters gathered.
    """
    reset = getattr(model, "reset_iter_state", None)  # FSDP roots (absent in older torch: nothing to do)
    if reset is not None and not getattr(getattr(model, "posttrain_fsdp", None), "gathered", False):
        reset()


def _stand_in_row(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One all-valid row of token 0 (``[1, P+R]``, ``[1, R]``) for a rank that got no rows but must
    still run the forwards of the others' micro-batches; its output is discarded."""
    seq_len, resp_len = tensors["input_ids"].shape[1], tensors["responses"].shape[1]
    ids = torch.zeros(1, seq_len, dtype=tensors["input_ids"].dtype)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(seq_len)[None],
            "responses": torch.zeros(1, resp_len, dtype=tensors["responses"].dtype)}
