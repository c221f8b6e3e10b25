"""Token log-probabilities and entropies from logits: the math, in one place.

`logprob_and_entropy` is what training computes: `posttrain.models.logprobs` (model + batch ->
response log-probs) runs the backbone, keeps the hidden states of valid response tokens, and calls
it on one chunk of their logits at a time (so no `[batch, seq, vocab]` float32 tensor ever exists);
`logit_gradient` is its backward's formula, which that module's one-node ``lm_head`` backward applies
to slices of the vocabulary. `logprobs_from_logits` and `entropy_from_logits` are verl 0.9's
direct forms (`verl/utils/torch_functional.py`) for code ported from verl and the entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["entropy_from_logits", "logit_gradient", "logprob_and_entropy", "logprob_entropy_sum_pi_squared",
           "logprobs_from_logits"]


def logprob_and_entropy(logits: torch.Tensor, labels: torch.Tensor, calculate_entropy: bool = True,
                        entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits ``[t, V]`` (already divided by the temperature), labels ``[t]`` ->
    (log-prob ``[t]``, entropy ``[t]``, or an empty tensor when ``calculate_entropy`` is False).

    log-prob = log_softmax(logits)[label]; entropy = -sum(softmax * log_softmax). torch's fused
    ``log_softmax`` passes over the ``[t, V]`` chunk fewer times than ``logit[label] -
    logsumexp(logits)``, a third of the time forward + backward (benchmarks/README.md, "Figures behind
    the package's design"). The backward is :class:`_LogProbEntropy`'s, one pass over the chunk. ``entropy_grad=False``
    computes the entropy without a graph (a metric, not a loss term).
    """
    if not (logits.requires_grad and torch.is_grad_enabled()):
        with torch.no_grad():
            return _LogProbEntropy.values(logits, labels, calculate_entropy)[:2]
    return _LogProbEntropy.apply(logits, labels, calculate_entropy, entropy_grad)


def logprob_entropy_sum_pi_squared(logits: torch.Tensor, labels: torch.Tensor, calculate_entropy: bool = True,
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprob_and_entropy` without gradient, plus ``sum_v softmax(logits)_v^2`` ``[t]``: the squared
    norm term of the optimal token baseline (`posttrain.algorithms.optimal_token_baseline`).

    Computed as the dot product of the softmax with itself from the chunk's own temporaries: the softmax
    the entropy already made, or else the ``log_softmax`` turned into it in place, so no further ``[t, V]``
    tensor exists. verl's ``exp(logsumexp(2 z) - 2 logsumexp(z))`` is the same number (float32 rounding).
    """
    with torch.no_grad():
        logp, entropy, log_probs, probs = _LogProbEntropy.values(logits, labels, calculate_entropy)
        if probs is None:
            probs = log_probs.exp_()  # log_probs is this call's own and read no more
        with torch.autocast(logits.device.type, enabled=False):  # float32 stays float32
            sum_pi_squared = torch.bmm(probs.unsqueeze(1), probs.unsqueeze(2)).view(-1)
    return logp, entropy, sum_pi_squared


class _LogProbEntropy(torch.autograd.Function):
    """log-prob at the label and entropy of ``softmax(logits)``, with the gradient in one pass.

    Autograd's own backward of these ops writes a zero ``[t, V]`` tensor, scatters the label's
    gradient into it, then runs ``log_softmax``'s backward (and the entropy's, when it has one):
    four passes over the chunk. Here, with ``p = softmax(logits)`` and ``H`` the entropy,
    ``d logp_y / dz = onehot(y) - p`` and ``dH / dz = -p * (log p + H)``, so the gradient is
    ``-p * (g_logp + g_H * (log p + H))`` plus ``g_logp`` at the label: one pass over ``p``, kept
    from the forward (where the entropy needed it) or recomputed from the ``log_softmax`` output.
    The entropy's sum over the vocabulary is a batched dot product (no ``p * log p`` tensor).
    """

    @staticmethod
    def values(logits: torch.Tensor, labels: torch.Tensor, calculate_entropy: bool):
        """(log-prob ``[t]``, entropy ``[t]`` or empty, log_softmax ``[t, V]``, softmax ``[t, V]`` or None)."""
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if not calculate_entropy:
            return logp, logp.new_zeros(0), log_probs, None
        probs = log_probs.exp()
        with torch.autocast(logits.device.type, enabled=False):  # float32 stays float32 (autocast would take bmm to bf16)
            entropy = -torch.bmm(probs.unsqueeze(1), log_probs.unsqueeze(2)).view(-1)
        return logp, entropy, log_probs, probs

    @staticmethod
    def forward(ctx, logits, labels, calculate_entropy: bool, entropy_grad: bool):
        logp, entropy, log_probs, probs = _LogProbEntropy.values(logits, labels, calculate_entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not a zero tensor
        ctx.entropy_grad = calculate_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        # keep what backward reads: p (and log p only when the entropy has a gradient)
        kept = (probs, log_probs, entropy) if ctx.entropy_grad else (probs if probs is not None else log_probs,)
        ctx.probs_kept = probs is not None
        ctx.save_for_backward(labels, *kept)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        labels, first, *rest = ctx.saved_tensors
        probs = first if ctx.probs_kept else first.exp()
        if grad_logp is None:
            grad_logp = probs.new_zeros(probs.shape[0])
        if ctx.entropy_grad and grad_entropy is not None:
            log_probs, entropy = rest
            return logit_gradient(probs, grad_logp, labels, log_probs, entropy, grad_entropy), None, None, None
        # without kept probs, ``probs`` is this pass's own exp(): the gradient is built in place
        return logit_gradient(probs, grad_logp, labels, reuse=not ctx.probs_kept), None, None, None


def logit_gradient(probs: torch.Tensor, grad_logp: torch.Tensor, labels: torch.Tensor,
                   log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                   grad_entropy: torch.Tensor | None = None, reuse: bool = False) -> torch.Tensor:
    """Gradient ``[t, v]`` with respect to the logits of the ``v`` columns that ``probs`` covers:
    ``-p * (g_logp + g_H * (log p + H))`` plus ``g_logp`` at the label (:class:`_LogProbEntropy`).

    probs, log_probs: ``[t, v]``, softmax over the *whole* vocabulary restricted to these columns;
    grad_logp, entropy, grad_entropy ``[t]`` (no entropy term when ``grad_entropy`` is None); labels
    ``[t]`` index these columns: a label outside ``[0, v)`` adds nothing, so a caller can walk the
    vocabulary in slices. ``reuse``: ``probs`` and ``log_probs`` are the caller's own temporaries,
    overwritten to build the result (no other ``[t, v]`` tensor).
    """
    if grad_entropy is None:
        scale = -grad_logp[:, None]
    else:
        shifted = log_probs.add_(entropy[:, None]) if reuse else log_probs + entropy[:, None]
        scale = shifted.mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).neg_()
    grad = probs.mul_(scale) if reuse else probs * scale
    _add_at_labels(grad, labels, grad_logp)
    return grad


def _add_at_labels(grad: torch.Tensor, labels: torch.Tensor, values: torch.Tensor) -> None:
    """``grad[i, labels[i]] += values[i]`` for the rows whose label is one of ``grad``'s columns."""
    width = grad.shape[1]
    inside = (labels >= 0) & (labels < width)  # a mask, not a selection: no device sync on a GPU
    at = torch.arange(grad.shape[0], device=grad.device) * width + labels.clamp(0, max(width - 1, 0))
    # (advanced-index += is far slower on CPU)
    grad.view(-1).index_add_(0, at, torch.where(inside, values, 0).to(grad.dtype))


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
