"""Split a batch into micro-batches by rows or by a token budget (verl's dynamic batch size)."""

from __future__ import annotations

import torch

__all__ = ["split_rows", "split_by_tokens", "micro_batch_indices"]


def split_rows(num_rows: int, micro_batch_size: int) -> list[torch.Tensor]:
    """``[0..num_rows)`` in consecutive groups of ``micro_batch_size`` (the last may be shorter)."""
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    return list(torch.arange(num_rows).split(micro_batch_size))


def split_by_tokens(attention_mask: torch.Tensor, max_token_len: int) -> list[torch.Tensor]:
    """Groups of row indices whose padded cost ``rows * longest row`` stays within ``max_token_len``.

    attention_mask: ``[N, S]``. Rows are sorted longest first and packed greedily, so rows of
    similar length share a micro-batch; a row longer than the budget gets a micro-batch alone.
    Callers that need the original order scatter results back with the returned indices.
    """
    lengths = attention_mask.sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * max(longest, lengths[i]) <= max_token_len:
            groups[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            groups.append([i])
            longest = lengths[i]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def micro_batch_indices(
    attention_mask: torch.Tensor,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
) -> list[torch.Tensor]:
    """Row-index groups: by tokens when ``use_dynamic_bsz`` else by ``micro_batch_size`` rows."""
    if use_dynamic_bsz:
        if not max_token_len:
            raise ValueError("use_dynamic_bsz needs a positive max_token_len")
        return split_by_tokens(attention_mask, max_token_len)
    return split_rows(attention_mask.shape[0], micro_batch_size or attention_mask.shape[0])
