"""The reward-model role (``reward_model.enable``): one learned score per response, placed on its
last valid response token, like a rule-based score.

What the reward model reads follows verl's ``RewardModelWorker`` (``fsdp_workers.py``):

- ``reward_model.model.input_tokenizer`` set (verl's default: the actor's path): each row's prompt
  messages (``raw_prompt``) plus the response decoded with that tokenizer (special tokens kept,
  the eos text removed) become one chat, rendered by the reward model's own chat template with
  ``add_generation_prompt=False``, tokenized without extra special tokens, right-padded, and cut
  from the right at ``reward_model.max_length`` (null: the actor's prompt + response width).
- ``input_tokenizer`` null: the reward model reads the actor's ``input_ids`` as they are.

Then a frozen forward in micro-batches (``micro_batch_size_per_gpu`` rows, or by tokens with
``use_dynamic_bsz``), without gradients, and the score head's output at each row's last valid
token (`posttrain.models.reward_model.last_token_scores`).

Shapes: ``N`` responses, ``R`` response length, ``S`` reward-model input length.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

from posttrain.batch import Batch
from posttrain.models.logprobs import forget_forward_record  # the reference's forward-only FSDP care
from posttrain.models.microbatch import equal_micro_batch_count, is_sharded, micro_batch_indices
from posttrain.models.precision import autocast_context
from posttrain.models.reward_model import import_external_lib, last_token_scores
from posttrain.rewards.manager import place_on_last_token, response_mask_of

__all__ = ["RewardModelWorker", "per_rank_micro_batch", "render_for_reward_model"]


def per_rank_micro_batch(config: Any, world_size: int) -> int | None:
    """Rows per reward-model forward on one rank: ``micro_batch_size_per_gpu``, or verl's deprecated
    global ``micro_batch_size`` divided by the ranks (validation refuses both set, or a quotient of 0)."""
    if config.micro_batch_size is not None:
        return max(1, config.micro_batch_size // world_size)
    return config.micro_batch_size_per_gpu


def render_for_reward_model(messages: Sequence[dict], response: str, rm_tokenizer: Any) -> str:
    """The prompt's chat plus the response as the assistant's turn, in the reward model's chat template."""
    chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
    return rm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)


def decode_response(ids: Sequence[int], input_tokenizer: Any) -> str:
    """verl's decoding: special tokens kept, the eos text removed."""
    text = input_tokenizer.decode(list(ids))
    eos = input_tokenizer.eos_token
    return text.replace(eos, "") if eos else text


class RewardModelWorker:
    """A frozen reward model and the tokenizers it needs.

    Args:
        module: a sequence-classification model (`load_reward_model`), placed (`posttrain.workers.build`
            prepares it; a raw module is moved to ``device``), possibly FSDP-sharded.
        config: the ``reward_model`` section (``max_length``, ``use_dynamic_bsz``,
            ``forward_max_token_len_per_gpu``, ``model.fsdp_config``).
        rm_tokenizer: the reward model's tokenizer (its chat template renders the inputs).
        input_tokenizer: decodes the actor's responses; None feeds the actor's ids unchanged.
        micro_batch_size: rows per forward on this rank (`per_rank_micro_batch`).
        param_dtype: compute precision (bf16 autocast or fp32) that `posttrain.workers.build` decided
            (the actor's, when the reward model's is ``auto``); None: the config's, which must then
            not be ``auto`` (``auto`` follows the actor, which only the builder knows).
    """

    def __init__(self, module: nn.Module, config: Any, *, rm_tokenizer: Any, input_tokenizer: Any = None,
                 micro_batch_size: int | None = None, device: str | torch.device = "cpu",
                 param_dtype: str | None = None):
        self.config, self.rm_tokenizer, self.input_tokenizer = config, rm_tokenizer, input_tokenizer
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.module = module.to(self.device).eval().requires_grad_(False)
        text_config = self.module.config.get_text_config()
        if text_config.pad_token_id is None:  # transformers refuses batches of > 1 row without one
            text_config.pad_token_id = rm_tokenizer.pad_token_id
        self.param_dtype = param_dtype or config.model.fsdp_config.mixed_precision.param_dtype
        if self.param_dtype == "auto":
            raise ValueError("RewardModelWorker: reward_model.model.fsdp_config.mixed_precision.param_dtype=auto "
                             "follows the actor's precision; pass param_dtype (posttrain.workers.build does)")
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)
        self._shown_example = self._warned_cut = False

    @classmethod
    def from_config(cls, config: Any, actor_tokenizer: Any, actor_path: str, module: nn.Module, *,
                    device: str | torch.device = "cpu", param_dtype: str | None = None,
                    world_size: int = 1) -> "RewardModelWorker":
        """The worker of the ready ``module`` (`posttrain.workers.build`), with the tokenizers named by
        ``config.model``.

        ``input_tokenizer`` equal to the actor's path reuses the actor's tokenizer object (its custom
        chat template included); another path loads that tokenizer.
        """
        from posttrain.models import load_tokenizer

        m = config.model
        import_external_lib(m.external_lib)
        rm_tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        input_tokenizer = None
        if m.input_tokenizer is not None:
            same = str(m.input_tokenizer) == str(actor_path) and actor_tokenizer is not None
            input_tokenizer = actor_tokenizer if same else load_tokenizer(m.input_tokenizer,
                                                                          trust_remote_code=m.trust_remote_code)
        return cls(module, config, rm_tokenizer=rm_tokenizer, input_tokenizer=input_tokenizer,
                   micro_batch_size=per_rank_micro_batch(config, world_size), device=device, param_dtype=param_dtype)

    # ------------------------------------------------------------------ inputs
    def texts(self, batch: Batch) -> list[str]:
        """Each row's chat as the reward model's template renders it (re-templating only)."""
        if "raw_prompt" not in batch.non_tensor_batch:
            raise KeyError("re-templating for the reward model needs each prompt's chat messages (the batch key "
                           "'raw_prompt', from data.return_raw_chat=True); or set reward_model.model.input_tokenizer="
                           "null to score the actor's tokens as they are")
        mask = response_mask_of(batch).bool().cpu()
        responses = batch["responses"].cpu()
        return [render_for_reward_model(list(messages), decode_response(responses[i][mask[i]].tolist(),
                                                                        self.input_tokenizer), self.rm_tokenizer)
                for i, messages in enumerate(batch.non_tensor_batch["raw_prompt"])]

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``position_ids`` ``[N, S]`` the reward model reads."""
        if self.input_tokenizer is None:
            return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        texts = self.texts(batch)
        self._show_once(texts[0])
        max_length = self.config.max_length or batch["attention_mask"].shape[1]
        return self._encode(texts, max_length)

    def _encode(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        """Right-padded ids, cut from the right at ``max_length`` (verl's ``postprocess_data``)."""
        rows = [self.rm_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        cut = sum(len(r) > max_length for r in rows)
        if cut and not self._warned_cut:  # once per run: verl cuts silently, a note is enough
            self._warned_cut = True
            print(f"note: {cut} of {len(rows)} reward-model inputs were longer than {max_length} tokens and were cut "
                  "from the right (reward_model.max_length; when null, the actor's prompt + response width, as in "
                  "verl); set reward_model.max_length to keep them whole. Later cuts are not reported", flush=True)
        rows = [r[:max_length] for r in rows]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.rm_tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}

    def _show_once(self, text: str) -> None:
        """The first re-templated input, once per run, as verl prints it: the template is easy to get wrong."""
        if not self._shown_example:
            self._shown_example = True
            shown = text if len(text) <= 600 else text[:300] + " [...] " + text[-300:]
            print(f"reward model input (re-templated, first row): {shown!r}", flush=True)

    # ------------------------------------------------------------------ scoring
    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        """``[N, R]`` float32: each response's reward-model score on its last valid token, zeros elsewhere."""
        scores = self.sequence_scores(self.model_inputs(batch))
        return place_on_last_token(scores, response_mask_of(batch).cpu())

    def sequence_scores(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[N]`` float32 scores of ``inputs`` (`model_inputs`), micro-batched on this rank."""
        mask = inputs["attention_mask"]
        groups = micro_batch_indices(mask, self.micro_batch_size, bool(self.config.use_dynamic_bsz),
                                     self.config.forward_max_token_len_per_gpu, sort_by_length=True)
        # under FSDP every forward is a collective: all ranks run as many (a padding entry is dropped)
        plan = equal_micro_batch_count(groups) if is_sharded(self.module) else [(g, False) for g in groups]
        scores = torch.zeros(mask.shape[0], dtype=torch.float32)
        with torch.no_grad(), self.autocast():
            for rows, padding in plan:
                micro = _trim_padding({k: v[rows.to(v.device)] for k, v in inputs.items()})
                out = last_token_scores(self.module, **{k: v.to(self.device) for k, v in micro.items()})
                if not padding:
                    scores[rows.cpu()] = out.cpu()
        forget_forward_record(self.module)
        return scores


def _trim_padding(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row of a micro-batch (rows of similar length share one)."""
    valid = micro["attention_mask"].bool().any(dim=0).nonzero().flatten()
    if valid.numel() == 0:
        return micro
    cols = slice(int(valid[0]), int(valid[-1]) + 1)
    return {k: v[:, cols] for k, v in micro.items()}
