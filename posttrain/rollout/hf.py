"""The ``hf`` rollout engine: a ``transformers`` causal LM decoded with a KV cache.

Hybrid engine: the engine holds the actor's own module (no copy), so ``update_weights`` with that
module is a no-op. Generation runs in eval mode (no dropout) under bf16 autocast when the actor's
``param_dtype`` is bf16, and restores the module's training mode afterwards.

Decoding (our own loop over the model's forward, not ``model.generate``): each distinct prompt is
prefilled once (columns that are padding in every prompt dropped) and its KV cache repeated for
its ``n`` samples, so prefill costs ``N`` prompts, not ``N * n`` rows; then all rows decode one
token per step (logits of the last position only) until every row has emitted EOS or
``response_length`` tokens. Sampling follows ``transformers``: temperature, top-k, top-p, softmax,
then one draw per row on the global torch RNG (inverse transform, not ``torch.multinomial``: the
same distribution at a tenth of the cost); greedy is argmax.

``rollout_log_probs`` are ``log_softmax(logits / temperature)`` at the sampled token, from the
model's raw logits at each decoding step: the same quantity the actor's ``compute_log_prob``
recomputes (temperature applied, top-k/top-p truncation *not* applied), so the two agree to float
precision in fp32. They are taken one step at a time, so no ``[steps, N, V]`` tensor is kept.
Greedy decoding reports log-probs at temperature 1.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch import nn

from posttrain.batch import Batch
from posttrain.models.attention import fast_cpu_attention
from posttrain.models.shared_prefix import shared_beginning
from posttrain.rollout.lean_decoder import LeanDecoder, lean_decoder_for
from posttrain.rollout.base import SamplingParams, assemble_rollout_batch, prompt_positions, with_uids

__all__ = ["HFRolloutEngine", "assemble_rollout_batch", "response_mask_from_eos"]  # assemble_rollout_batch: re-exported


def response_mask_from_eos(responses: torch.Tensor, eos_ids: list[int], num_generated: int) -> torch.Tensor:
    """``[N, R]`` long mask: 1 on tokens up to and including the first EOS, within the generated steps."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    generated = torch.arange(responses.shape[1], device=responses.device) < num_generated
    return (~after_eos & generated).long()


class HFRolloutEngine:
    """Generation with a KV-cached decoding loop (see module docstring).

    Args:
        model: a HF causal LM (the actor's module for the hybrid engine).
        tokenizer: supplies ``pad_token_id`` and ``eos_token_id``.
        autocast: context-manager factory for compute precision (e.g. bf16 autocast), or None.
        max_batch_size: rows (prompts times ``n``) decoded together.
        eos_token_ids: stop tokens; default the tokenizer's EOS plus the model generation config's.
        lean_decode: decode Llama-family models with :mod:`posttrain.rollout.lean_decoder` (the same
            logits in fewer ops); False keeps the model's own forward for every step.

    ``pause_point`` (set by an asynchronous rollout worker for verl's partial rollouts): called between two
    decoding steps; it may load new weights into ``model`` and returns True when it did. The rows still
    running are then prefilled again (prompt and tokens so far) under the new weights, which sample the
    rest of the response: every token comes from, and carries the log-prob of, the weights that sampled it.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        autocast: Callable[[], Any] | None = None,
        max_batch_size: int = 1024,
        eos_token_ids: list[int] | None = None,
        lean_decode: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.autocast = autocast
        self.max_batch_size = max_batch_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids or self._default_eos_ids()
        self.lean_decode = lean_decode
        self.pause_point: Callable[[], bool] | None = None

    def _default_eos_ids(self) -> list[int]:
        ids = [self.tokenizer.eos_token_id]
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
        return sorted({int(i) for i in ids if i is not None})

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (a module or a state dict); a no-op when given the engine's own module."""
        if weights is self.model:
            return
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        self.model.load_state_dict(state)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``N`` prompts -> ``N * sampling.n`` rows (keys in ``posttrain.rollout.base``)."""
        prompts = with_uids(prompts)
        rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        per_call = max(1, self.max_batch_size // sampling.n)  # prompts per decoding batch
        pos = prompts["position_ids"] if "position_ids" in prompts else prompt_positions(prompts["attention_mask"])
        was_training = self.model.training
        self.model.eval()
        try:
            outs = [self._generate_chunk(prompts["input_ids"][i:i + per_call], prompts["attention_mask"][i:i + per_call],
                                         pos[i:i + per_call], sampling)
                    for i in range(0, len(prompts), per_call)]
        finally:
            self.model.train(was_training)
        return self._assemble(rows, outs, sampling)

    @torch.no_grad()
    def _generate_chunk(self, input_ids, attention_mask, position_ids, sampling: SamplingParams):
        """``[B, P]`` distinct prompts -> (responses ``[B*n, T]``, log-probs ``[B*n, T]`` or None), ``T <= R``.

        Each prompt is prefilled once; its KV cache and last logits are then repeated for its ``n``
        samples, which decode together one token per step. Rows that have emitted EOS leave the
        decoding batch (their cache rows are dropped), so a step costs the rows still running.
        """
        device = next(self.model.parameters()).device
        n, steps_max = sampling.n, sampling.response_length
        used = attention_mask.bool().any(0).nonzero()
        lo = int(used[0]) if used.numel() else max(input_ids.shape[1] - 1, 0)  # drop all-padding columns
        ids, mask, pos = (t[:, lo:].to(device) for t in (input_ids, attention_mask, position_ids))
        rows = ids.shape[0] * n
        responses = torch.full((rows, max(steps_max, 0)), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros(rows, max(steps_max, 0), dtype=torch.float32, device=device)
        if steps_max <= 0:
            return responses, None
        step = _ModelStepper(self.model, self.lean_decode)
        ctx = self.autocast() if self.autocast is not None else contextlib.nullcontext()
        eos = torch.tensor(self.eos_token_ids, device=device)
        alive = torch.arange(rows, device=device)  # output row of each decoding-batch row
        prompt_rows = (tuple(x.repeat_interleave(n, dim=0) for x in (ids, mask, pos))  # kept for a re-prefill
                       if self.pause_point is not None else None)
        steps = 0
        with ctx, fast_cpu_attention(self.model):
            logits, mask = _prefill(step, ids, mask, pos)  # [B, V]; the prompts' mask as the cache holds them
            if n > 1 and not step.repeat(n):  # a cache type that cannot be repeated: prefill every row
                ids, mask, pos = (x.repeat_interleave(n, dim=0) for x in (ids, mask, pos))
                step = _ModelStepper(self.model, self.lean_decode)
                logits = step.prefill(ids, mask, pos)
            elif n > 1:
                logits = logits.repeat_interleave(n, dim=0)
                mask, pos = mask.repeat_interleave(n, dim=0), pos.repeat_interleave(n, dim=0)
            pos = pos[:, -1:]
            step.reserve(steps_max)  # the cache gets room for the whole response (no copy per step)
            ended = torch.zeros(rows, dtype=torch.bool, device=device)  # rows of the decoding batch done
            for t in range(steps_max):
                token, lp = _sample(logits, sampling, sampling.calculate_log_probs)
                live = ~ended
                responses[alive[live], t] = token[live]
                if lp is not None:
                    log_probs[alive[live], t] = lp[live]
                steps = t + 1
                ended = ended | torch.isin(token, eos)
                if t == steps_max - 1 or bool(ended.all()):
                    break
                if bool(ended.any()):  # drop finished rows from the batch and the cache (when the cache can)
                    keep = (~ended).nonzero().flatten()
                    if step.select(keep):
                        alive, token, mask, pos, ended = alive[keep], token[keep], mask[keep], pos[keep], ended[keep]
                if self.pause_point is not None and self.pause_point():  # new weights: the cache is stale
                    step, logits, mask, pos = self._prefill_again(prompt_rows, responses, alive, t, steps_max)
                    continue
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = pos + 1
                logits = step.decode(token[:, None], mask, pos)
        return responses[:, :steps], (log_probs[:, :steps] if sampling.calculate_log_probs else None)

    def _prefill_again(self, prompt_rows: tuple, responses: torch.Tensor, alive: torch.Tensor, t: int,
                       steps_max: int):
        """A fresh cache for the decoding batch's rows (prompt + tokens ``0..t``) under the model's current
        weights: ``(stepper, next-token logits, mask, last position)``, room reserved for the rest."""
        ids, mask, pos = (x[alive] for x in prompt_rows)
        generated = t + 1
        ids = torch.cat([ids, responses[alive, :generated]], dim=1)
        mask = torch.cat([mask, mask.new_ones(len(alive), generated)], dim=1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, generated + 1, device=pos.device)], dim=1)
        step = _ModelStepper(self.model, self.lean_decode)
        logits, mask = _prefill(step, ids, mask, pos)
        step.reserve(steps_max - generated)
        return step, logits, mask, pos[:, -1:]

    def _assemble(self, rows: Batch, outs: list, sampling: SamplingParams) -> Batch:
        dev = rows["input_ids"].device  # outputs live where the prompts do
        responses = torch.full((len(rows), sampling.response_length), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros(len(rows), sampling.response_length, dtype=torch.float32, device=dev)
        mask = torch.zeros(len(rows), sampling.response_length, dtype=torch.long, device=dev)
        start = 0
        for resp, lp in outs:
            stop, steps = start + resp.shape[0], resp.shape[1]
            responses[start:stop, :steps] = resp.to(dev)
            mask[start:stop] = response_mask_from_eos(responses[start:stop], self.eos_token_ids, steps)
            if lp is not None:
                log_probs[start:stop, :steps] = lp.to(dev)
            start = stop
        return assemble_rollout_batch(rows, responses, mask, log_probs if sampling.calculate_log_probs else None,
                                      self.pad_token_id)


SHARED_PREFIX_MIN_TOKENS = 16
"""Prompts whose first tokens agree on at least this many (a system prompt, a worked example, a
template) have those tokens prefilled once for the batch (:func:`_prefill`)."""


def _prefill(step: "_ModelStepper", ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor):
    """The prompts' cache and last logits, and the attention mask of what the cache holds.

    Prompts that begin with the same tokens (the chat template's system prompt, a worked example)
    share them: those are prefilled once, as a batch of one, the cache is repeated
    for every prompt, and each prompt's own tokens are prefilled after them. The cache then holds
    ``[shared | each prompt's own tokens, right-aligned]``, with the columns between masked out; the
    returned mask says so. Each real token sees the same tokens at the same positions as in a plain
    prefill, so the logits and cache entries are the plain prefill's up to float rounding (the shared
    part is one row of a product instead of ``B``). The built-in run's 128 validation prompts share
    63 of their 76 tokens, so a validation pass takes well under half the time (benchmarks/README.md,
    "Shared prefill"). Otherwise (fewer
    shared tokens, one prompt, a cache that cannot be repeated) a plain prefill.
    """
    shared = _shared_prefix_length(ids, mask, pos)
    if shared < SHARED_PREFIX_MIN_TOKENS:
        return step.prefill(ids, mask, pos), mask
    rows, width = ids.shape
    starts = width - mask.sum(1)  # first real token of each (left-padded) row
    first = int(starts[0])
    step.prefill(ids[:1, first:first + shared], mask[:1, first:first + shared], pos[:1, first:first + shared])
    if not step.expand(rows):
        step.cache = None
        return step.prefill(ids, mask, pos), mask
    step.shared_prefix = shared  # a lean decoder keeps these positions once (the expanded cache repeats them)
    own = width - int(starts.min()) - shared  # the longest prompt's own tokens
    columns = torch.arange(width - own, width, device=ids.device)
    own_mask = (columns[None] >= (starts + shared)[:, None]).to(mask.dtype)
    held = torch.cat([mask.new_ones(rows, shared), own_mask], dim=1)
    return step.decode(ids[:, -own:], held, pos[:, -own:]), held


def _shared_prefix_length(ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> int:
    """How many first tokens (and positions) all left-padded rows share, leaving each row at least one
    token of its own; 0 for one row or for rows that are not left-padded."""
    rows, width = ids.shape
    if rows < 2:
        return 0
    lengths = mask.sum(1)
    starts = width - lengths
    columns = torch.arange(width, device=ids.device)
    if not torch.equal(mask.bool(), columns[None] >= starts[:, None]):
        return 0
    most = int(lengths.min()) - 1
    if most < 1:
        return 0
    at = starts[:, None] + columns[None, :most]
    return shared_beginning(ids.gather(1, at), pos.gather(1, at), lengths)


def _sample(logits: torch.Tensor, sampling: SamplingParams, want_log_probs: bool):
    """Next tokens ``[N]`` from raw logits ``[N, V]`` and, when asked, their log-probs ``[N]``.

    As ``transformers``' sampling: temperature, then top-k, then top-p (HF's warpers, same cut
    rules), then one draw from the softmax (:func:`_draw`); greedy is argmax. The reported log-prob
    is ``log_softmax(logits / temperature)`` (temperature 1 when greedy) at the chosen token, with
    no top-k/top-p truncation: what the actor's ``compute_log_prob`` recomputes.
    """
    scores = logits.float()
    if sampling.greedy:
        token = scores.argmax(-1)
    else:
        if sampling.temperature != 1.0:
            scores = scores / sampling.temperature
        filtered = scores
        if sampling.top_k > 0:
            kth = torch.topk(filtered, min(sampling.top_k, filtered.shape[-1]), dim=-1).values[..., -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_logits, sorted_idx = torch.sort(filtered, descending=False)
            remove = sorted_logits.softmax(-1).cumsum(-1) <= (1 - sampling.top_p)
            remove[..., -1:] = False
            filtered = filtered.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
        token = _draw(filtered)
    if not want_log_probs:
        return token, None
    lp = scores.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    return token, lp


def _draw(scores: torch.Tensor) -> torch.Tensor:
    """One token per row of ``softmax(scores)`` ``[N, V]`` by inverse transform sampling: one uniform
    number per row (the global torch RNG) located in the row's cumulative probabilities (float64).

    The same distribution as ``torch.multinomial(probs, 1)``, which draws an exponential number per
    vocabulary entry: a sizeable part of a small model's decoding step on CPU, many times this draw's
    cost (benchmarks/README.md, "Sampling"). Tokens of probability 0 (cut by top-k/top-p) are never
    drawn: the cumulative sum does not rise at them, and the search returns the first index whose sum
    exceeds the uniform number.
    """
    cdf = torch.softmax(scores, dim=-1).cumsum(-1, dtype=torch.float64)
    target = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


class _ModelStepper:
    """Prefill / one-token decode with a KV cache, on the backbone + lm_head when the model splits
    (logits of the last position only), across ``transformers`` versions (``cache``/``past_key_values``).
    After :meth:`reserve`, a Llama-family model decodes through a :class:`LeanDecoder` holding the cache."""

    def __init__(self, model: nn.Module, lean_decode: bool = False):
        from posttrain.models.logprobs import split_lm

        self.model = model
        parts = split_lm(model)
        self.body, self.head = (parts[0], parts[1]) if parts is not None else (None, None)
        self.softcap = parts[2] if parts is not None else None
        target = self.body if self.body is not None else model
        params = inspect.signature(target.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep")
                             if self.body is None and k in inspect.signature(model.forward).parameters), None)
        self.cache = None
        self.lean_decode = lean_decode
        self.lean: LeanDecoder | None = None
        self.samples = 1  # rows per cached prompt, for the lean decoder (which keeps one copy of each prompt)
        self.shared_prefix = 0  # first cache positions identical in every prompt (`_prefill`)

    def _run(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        if self.cache is not None:
            kwargs[self.cache_kw] = self.cache
        if self.body is None:
            if self.keep_kw:
                kwargs[self.keep_kw] = 1
            out = self.model(**kwargs)
            logits = out.logits[:, -1]
        else:
            out = self.body(**kwargs)
            logits = self.head(out.last_hidden_state[:, -1])
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else out.past_key_values
        return logits

    def prefill(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        return self._run(input_ids, attention_mask, position_ids)

    def repeat(self, n: int) -> bool:
        """Repeat each cache row ``n`` times (interleaved); False when the cache type cannot. A lean
        decoder keeps the one copy and decodes ``n`` rows from it."""
        if self.lean_decode:
            self.lean = lean_decoder_for(self.model, self.cache)
            self.lean_decode = self.lean is not None  # unsupported: reserve() need not ask again
            if self.lean is not None:
                self.samples = n
                return True
        return self.expand(n)

    def expand(self, rows: int) -> bool:
        """Repeat each cache row ``rows`` times (interleaved; a one-row cache becomes ``rows`` rows);
        False when the cache type cannot."""
        try:
            self.cache.batch_repeat_interleave(rows)
        except (AttributeError, NotImplementedError, TypeError):
            return False
        return True

    def reserve(self, new_tokens: int) -> bool:
        """Room in the cache for ``new_tokens`` more positions (``posttrain.rollout.kv_cache``), or the
        cache moved into a :class:`LeanDecoder` with that room."""
        from posttrain.rollout.kv_cache import reserve

        if self.lean is None and self.lean_decode:
            self.lean = lean_decoder_for(self.model, self.cache)
        if self.lean is not None:
            self.lean.load_cache(self.cache, new_tokens, self.samples, self.shared_prefix)
            self.cache = None
            return True
        return reserve(self.cache, new_tokens)

    def select(self, rows: torch.Tensor) -> bool:
        """Keep only ``rows`` (indices) of the cache's batch; False (cache unchanged) when it cannot."""
        if self.lean is not None:
            self.lean.select(rows)
            return True
        try:
            self.cache.batch_select_indices(rows)
        except (AttributeError, NotImplementedError, TypeError):
            return False
        return True

    def decode(self, tokens, attention_mask, position_ids) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.step(tokens, attention_mask, position_ids)
        return self._run(tokens, attention_mask, position_ids)
