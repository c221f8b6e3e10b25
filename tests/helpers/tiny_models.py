"""Tiny models, prompt batches and worker configs for tests (no downloads; CPU, seconds).

    tok = build_tiny_tokenizer()
    model = tiny_llama(tok)                      # 2 layers, hidden 64, random init, seeded
    prompts = tiny_prompt_batch(tok, ["1+1=", "hello 2*3="])
    cfg = tiny_worker_configs(response_length=8)  # .model .actor .rollout .ref .critic
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.batch import Batch
from posttrain.config.actor_rollout_ref import (
    ActorConfig,
    ActorModelConfig,
    FSDPConfig,
    MixedPrecisionConfig,
    OptimConfig,
    RefConfig,
    RefFSDPConfig,
    RolloutConfig,
)
from posttrain.config.critic import CriticConfig, CriticModelConfig

__all__ = ["eos_biased_tiny_llama", "grads_at_step", "tiny_llama", "tiny_prompt_batch", "tiny_worker_configs"]


def tiny_llama(tokenizer: Any, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A 2-layer, 64-wide random Llama for ``tokenizer``'s vocabulary, float32, eval-independent."""
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kwargs))



def eos_biased_tiny_llama(directory: Any, eos_weight: float) -> Any:
    """The tiny Llama and tokenizer saved to ``directory``, with the EOS logit set by one residual dimension.

    Dimension 0 is held at 1 (embeddings 1, no layer writes it), so after the final norm it reads ~8 and the
    EOS row of the output layer adds ``8 * eos_weight`` to the EOS logit: -4 makes EOS never come (endless
    responses), 3/8 makes a turn end after ~7 tokens."""
    from helpers.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = tiny_llama(tok)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = eos_weight
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory

def tiny_prompt_batch(tokenizer: Any, texts: list[str], uids: list[str] | None = None) -> Batch:
    """Left-padded prompts: ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P]`` (+ ``uid``)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    uids = uids if uids is not None else [f"p{i}" for i in range(len(texts))]
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": pos},
                           {"uid": np.array(uids, dtype=object)})


def tiny_worker_configs(
    *,
    response_length: int = 8,
    mini_batch_size: int = 4,
    micro_batch_size: int = 2,
    param_dtype: str = "fp32",
    temperature: float = 1.0,
    n: int = 1,
    lr: float = 1e-3,
    actor: dict | None = None,
    critic: dict | None = None,
) -> SimpleNamespace:
    """Resolved config sections (the real dataclasses, ``${...}`` defaults filled in) for tiny runs.

    ``actor`` / ``critic`` dicts override fields of ActorConfig / CriticConfig.
    """
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))
    ref_fsdp = RefFSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))
    model = ActorModelConfig(path="<tiny>", enable_gradient_checkpointing=False)
    actor_kw = dict(ppo_mini_batch_size=mini_batch_size, ppo_micro_batch_size_per_gpu=micro_batch_size,
                    use_remove_padding=False, optim=OptimConfig(lr=lr, weight_decay=0.0), fsdp_config=fsdp,
                    grad_clip=1e6)
    actor_kw.update(actor or {})
    rollout = RolloutConfig(
        temperature=temperature, n=n, response_length=response_length, prompt_length=64,
        log_prob_micro_batch_size_per_gpu=micro_batch_size, log_prob_use_dynamic_bsz=False,
        log_prob_max_token_len_per_gpu=4096)
    ref = RefConfig(strategy="fsdp", use_torch_compile=False, log_prob_micro_batch_size_per_gpu=micro_batch_size,
                    log_prob_use_dynamic_bsz=False, log_prob_max_token_len_per_gpu=4096,
                    ulysses_sequence_parallel_size=1, fsdp_config=ref_fsdp,
                    use_prefix_grouper=bool(actor_kw.get("use_prefix_grouper", False)))
    critic_kw = dict(
        rollout_n=n, ppo_mini_batch_size=mini_batch_size, ppo_micro_batch_size_per_gpu=micro_batch_size,
        use_dynamic_bsz=False, forward_max_token_len_per_gpu=4096, ppo_epochs=1, shuffle=False,
        use_prefix_grouper=False, loss_agg_mode="token-mean", grad_clip=1e6, optim=OptimConfig(lr=lr, weight_decay=0.0),
        model=CriticModelConfig(path="<tiny>", tokenizer_path="<tiny>", external_lib=None,
                                trust_remote_code=False, enable_gradient_checkpointing=False, compile_layers=False,
                                fsdp_config=fsdp))
    critic_kw.update(critic or {})
    return SimpleNamespace(model=model, actor=ActorConfig(**actor_kw), rollout=rollout, ref=ref,
                           critic=CriticConfig(**critic_kw))


def random_advantage_update(actor: Any, prompts: Batch, seed: int | None = None) -> None:
    """One PPO update of `actor` on its own samples of `prompts`, with a random advantage per response
    (seeded when `seed` is given): moves the policy, for tests that check what follows an update."""
    batch = actor.generate_sequences(prompts)
    batch.meta_info["temperature"] = 1.0
    if seed is not None:
        torch.manual_seed(seed)
    batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]) * batch["response_mask"]
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    actor.update_policy(batch)


def grads_at_step(worker) -> dict[str, torch.Tensor]:
    """Filled with the gradients ``worker``'s optimizer steps with (the update frees them after its step)."""
    names = {p: n for n, p in worker.module.named_parameters()}
    seen: dict[str, torch.Tensor] = {}
    worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.update(
        {names[p]: p.grad.clone() for group in opt.param_groups for p in group["params"] if p.grad is not None}))
    return seen
