"""The ``hf`` rollout engine: ``transformers`` ``model.generate`` with a KV cache.

Hybrid engine: the engine holds the actor's own module (no copy), so ``update_weights`` with that
module is a no-op. Generation runs in eval mode (no dropout) under bf16 autocast when the actor's
``param_dtype`` is bf16, and restores the module's training mode afterwards.

``rollout_log_probs`` are ``log_softmax(logits / temperature)`` at the sampled token, from the
model's raw logits at each decoding step: the same quantity the actor's ``compute_log_prob``
recomputes (temperature applied, top-k/top-p truncation *not* applied), so the two agree to float
precision in fp32. They are recorded one step at a time by a logits processor, so no
``[steps, N, V]`` tensor is kept. Greedy decoding reports log-probs at temperature 1.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from posttrain.batch import Batch
from posttrain.rollout.base import SamplingParams

__all__ = ["HFRolloutEngine", "response_mask_from_eos"]


class _LogProbRecorder(LogitsProcessor):
    """Records log p(sampled token) per step; sees raw logits before temperature/top-k/top-p warpers."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []  # each [N]
        self._prev: torch.Tensor | None = None  # [N, V] log-probs of the previous step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:
            self._take(input_ids[:, -1])
        self._prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self._prev.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        self._prev = None

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[N, steps]`` once generation has produced ``last_tokens`` ``[N]``."""
        if self._prev is not None:
            self._take(last_tokens)
        return torch.stack(self.steps, dim=1)


def response_mask_from_eos(responses: torch.Tensor, eos_ids: list[int], num_generated: int) -> torch.Tensor:
    """``[N, R]`` long mask: 1 on tokens up to and including the first EOS, within the generated steps."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    generated = torch.arange(responses.shape[1], device=responses.device) < num_generated
    return (~after_eos & generated).long()


class HFRolloutEngine:
    """Generation with ``model.generate`` (see module docstring).

    Args:
        model: a HF causal LM (the actor's module for the hybrid engine).
        tokenizer: supplies ``pad_token_id`` and ``eos_token_id``.
        autocast: context-manager factory for compute precision (e.g. bf16 autocast), or None.
        max_batch_size: prompts (times ``n``) per ``generate`` call.
        eos_token_ids: stop tokens; default the tokenizer's EOS plus the model generation config's.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        autocast: Callable[[], Any] | None = None,
        max_batch_size: int = 1024,
        eos_token_ids: list[int] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.autocast = autocast
        self.max_batch_size = max_batch_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids or self._default_eos_ids()

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
    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        greedy = sampling.greedy
        return GenerationConfig(
            max_new_tokens=sampling.response_length,
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k <= 0 else sampling.top_k,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    @torch.no_grad()
    def _generate_chunk(self, input_ids, attention_mask, sampling: SamplingParams):
        """``[B, P]`` prompts -> (responses ``[B, T]``, log-probs ``[B, T]`` or None), ``T <= R``."""
        device = next(self.model.parameters()).device
        recorder = _LogProbRecorder(sampling.logprob_temperature) if sampling.calculate_log_probs else None
        ctx = self.autocast() if self.autocast is not None else contextlib.nullcontext()
        with ctx:
            seqs = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(sampling),
                logits_processor=LogitsProcessorList([recorder] if recorder else []),
            )
        responses = seqs[:, input_ids.shape[1]:]
        if recorder is None or responses.shape[1] == 0:
            return responses, None
        return responses, recorder.finish(responses[:, -1])

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``N`` prompts -> ``N * sampling.n`` rows (keys in ``posttrain.rollout.base``)."""
        prompts = _with_uids(prompts)
        rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        was_training = self.model.training
        self.model.eval()
        try:
            outs = [self._generate_chunk(rows["input_ids"][i:i + self.max_batch_size],
                                         rows["attention_mask"][i:i + self.max_batch_size], sampling)
                    for i in range(0, len(rows), self.max_batch_size)]
        finally:
            self.model.train(was_training)
        return self._assemble(rows, outs, sampling)

    def _assemble(self, rows: Batch, outs: list, sampling: SamplingParams) -> Batch:
        resp_len = sampling.response_length
        prompt_ids, prompt_mask = rows["input_ids"], rows["attention_mask"]
        dev = prompt_ids.device  # outputs live where the prompts do
        responses = torch.full((len(rows), resp_len), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros(len(rows), resp_len, dtype=torch.float32, device=dev)
        mask = torch.zeros(len(rows), resp_len, dtype=torch.long, device=dev)
        start = 0
        for resp, lp in outs:
            stop, steps = start + resp.shape[0], resp.shape[1]
            responses[start:stop, :steps] = resp.to(dev)
            mask[start:stop] = response_mask_from_eos(responses[start:stop], self.eos_token_ids, steps)
            if lp is not None:
                log_probs[start:stop, :steps] = lp.to(dev)
            start = stop
        responses = responses.masked_fill(mask == 0, self.pad_token_id)
        prompt_pos = rows["position_ids"] if "position_ids" in rows else _positions(prompt_mask)
        resp_pos = prompt_pos[:, -1:] + torch.arange(1, resp_len + 1, device=dev)  # continue after the prompt (verl)
        tensors = {
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
        }
        if sampling.calculate_log_probs:
            tensors["rollout_log_probs"] = log_probs * mask
        return Batch.from_dict(tensors, dict(rows.non_tensor_batch), dict(rows.meta_info))


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``clip(cumsum(mask) - 1, 0)``: position ids of a left-padded prompt ``[N, P]``."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def _with_uids(prompts: Batch) -> Batch:
    """The prompts with a ``uid`` per row (kept when present, fresh uuid4 strings otherwise)."""
    if "uid" in prompts.non_tensor_batch:
        return prompts
    out = Batch(prompts.batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info))
    out.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
    return out
