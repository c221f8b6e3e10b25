"""Token log-probabilities and entropies from logits, direct and chunked.

The direct forms follow verl 0.9 (`verl/utils/torch_functional.py`). The chunked forms process
`chunk_size` rows (tokens) at a time, upcasting only that chunk to float32, so a float32
`[batch, seq, vocab]` log-softmax is never materialised; a custom autograd function recomputes the
chunk's softmax in backward and writes the gradient chunk by chunk into one logits-sized buffer.
They always return float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label]: logits `[..., vocab]`, labels `[...]` -> `[...]`.

    float32/float64: logit[label] - logsumexp(logits) per row; lower precision: log_softmax per
    leading row in the input dtype (verl's non-flash-attn path).
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = [
        F.log_softmax(row, dim=-1).gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
        for row, row_labels in zip(logits, labels, strict=True)
    ]
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): logsumexp(x) - sum(softmax(x) * x). `[..., vocab]` -> `[...]`."""
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Rows `[N, vocab]` -> (logprob `[N]` or empty, entropy `[N]` or empty), float32."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, want_logprob, want_entropy):
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n if want_logprob else 0, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk_size):
            x = logits[start : start + chunk_size].float()  # [chunk, vocab]
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[start : start + chunk_size] = chunk_lse
            if want_logprob:
                picked = x.gather(-1, labels[start : start + chunk_size].unsqueeze(-1)).squeeze(-1)
                logp[start : start + chunk_size] = picked - chunk_lse
            if want_entropy:
                probs = torch.exp(x - chunk_lse.unsqueeze(-1))
                ent[start : start + chunk_size] = chunk_lse - (probs * x).sum(-1)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels, lse, ent)
        for out, wanted in ((logp, want_logprob), (ent, want_entropy)):
            if not wanted:
                ctx.mark_non_differentiable(out)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, labels, lse, ent = ctx.saved_tensors
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        step = ctx.chunk_size
        for start in range(0, logits.shape[0], step):
            sl = slice(start, start + step)
            x = logits[sl].float()
            probs = torch.exp(x - lse[sl].unsqueeze(-1))  # [chunk, vocab]
            g = torch.zeros_like(x)
            if grad_logp is not None:  # d logp / dx = onehot(label) - p
                g -= probs * grad_logp[sl].unsqueeze(-1)
                g.scatter_add_(-1, labels[sl].unsqueeze(-1), grad_logp[sl].unsqueeze(-1))
            if grad_ent is not None:  # dH / dx = -p * (x - E_p[x]),  E_p[x] = lse - H
                mean_x = (lse[sl] - ent[sl]).unsqueeze(-1)
                g -= probs * (x - mean_x) * grad_ent[sl].unsqueeze(-1)
            grad[sl] = g.to(grad.dtype)
        return grad, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor | None, chunk_size: int = 1024, with_entropy: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Chunked, differentiable (logprob, entropy) of `[..., vocab]` logits, each `[...]` float32.

    labels `[...]` (None skips the log-probs); `with_entropy=False` skips the entropy.
    Peak extra memory is a few float32 `[chunk_size, vocab]` buffers.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1) if labels is not None else None
    logp, ent = _ChunkedLogprobEntropy.apply(flat, flat_labels, chunk_size, labels is not None, with_entropy)
    return (
        logp.view(lead) if labels is not None else None,
        ent.view(lead) if with_entropy else None,
    )


def logprobs_from_logits_chunked(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """`logprobs_from_logits` computed `chunk_size` rows at a time (float32 result)."""
    return logprobs_and_entropy(logits, labels, chunk_size, with_entropy=False)[0]


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """`entropy_from_logits` computed `chunk_size` rows at a time (float32 result)."""
    return logprobs_and_entropy(logits, None, chunk_size, with_entropy=True)[1]
