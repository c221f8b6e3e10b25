"""LoRA workers on a tiny random Llama (CPU, fp32): only adapters train, the base stays bit-identical,
the reference is the base model, generation runs the adapters, checkpoints hold the adapters and
resume exactly, the critic keeps its value head trainable, bad module names fail at start-up.

The tiny Llama: hidden 64, 4 heads of 16 (4 kv heads), MLP 128, 2 layers. LoRA rank 4 on all-linear
adapts q/k/v/o (64 -> 64 each) and gate/up (64 -> 128), down (128 -> 64) in both layers:
rank x (in + out) = 4 x (4 x 128 + 3 x 192) = 4352 per layer, 8704 in all.
"""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.batch import Batch
from posttrain.errors import ConfigError
from posttrain.checkpoint import CheckpointError
from posttrain.models.value_model import value_model_from_lm
from posttrain.rollout import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.workers import ActorWorker, CriticWorker
from posttrain.workers.actor import LoraReference
from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer

TEMP = 0.8
PROMPTS = ["1+1=", "hello 2*3=", "x", "what is 7-5?"]
ADAPTER_PARAMS = 8704  # the module docstring's count


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def lora_configs(rank=4, alpha=8, targets="all-linear", lr=1e-2, **kw):
    cfg = tiny_worker_configs(temperature=TEMP, lr=lr, **kw)
    cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules = rank, alpha, targets
    return cfg


def lora_actor(tok, seed=0, **kw):
    cfg = lora_configs(**kw)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok, seed=seed),
                        tokenizer=tok)
    return actor, cfg


def train_batch(actor, tok) -> Batch:
    """8 sampled responses (4 prompts x 2) with old log-probs, KL reference and random advantages."""
    torch.manual_seed(1)
    out = actor.rollout.generate(tiny_prompt_batch(tok, PROMPTS), SamplingParams(n=2, temperature=TEMP,
                                                                                  response_length=10))
    out.meta_info["temperature"] = TEMP
    lp, _ = actor.compute_log_prob(out)
    mask = out["response_mask"]
    g = torch.Generator().manual_seed(2)
    out.batch["old_log_probs"] = lp
    out.batch["ref_log_prob"] = lp.clone()
    out.batch["advantages"] = torch.randn(lp.shape, generator=g) * mask
    return out


def base_snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}


def changed(before: dict[str, torch.Tensor], module) -> list[str]:
    now = dict(module.named_parameters())
    return [n for n, t in before.items() if not torch.equal(t, now[n].detach())]


def full_logits(model, b) -> torch.Tensor:
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits


def naive_logprobs(model, b) -> torch.Tensor:
    """Reference log-probs: full logits, log-softmax, gather, masked (no chunking, no window)."""
    resp = b["responses"].shape[1]
    logits = full_logits(model, b)[:, -resp - 1:-1].double() / TEMP
    lp = torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return lp * b["response_mask"]


# ---------------------------------------------------------------------- what trains
def test_only_adapters_are_trainable_and_in_the_optimizer(tok):
    actor, _ = lora_actor(tok)
    held = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    trainable = {name for name, p in actor.module.named_parameters() if p.requires_grad}
    assert held == {id(p) for p in actor.module.parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for p in actor.module.parameters() if p.requires_grad) == ADAPTER_PARAMS
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in 2 layers; lm_head is not adapted
    assert not any("lm_head" in n or "embed" in n for n in trainable)


def test_an_update_moves_the_adapters_and_leaves_the_base_bit_identical(tok):
    actor, _ = lora_actor(tok)
    batch = train_batch(actor, tok)
    before = base_snapshot(actor.module)
    b_before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if ".lora_B." in n}
    metrics = actor.update_policy(batch)
    assert metrics["actor/grad_norm"] > 0
    assert changed(before, actor.module) == []
    moved = [n for n, p in actor.module.named_parameters() if n in b_before and not torch.equal(p, b_before[n])]
    assert len(moved) == len(b_before)  # every B left zero
    # negative control: the comparison sees the smallest change to one base weight
    name, weight = next((n, p) for n, p in actor.module.named_parameters() if n in before)
    with torch.no_grad():
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
    assert changed(before, actor.module) == [name]


def test_gradient_checkpointing_gives_the_same_adapter_update(tok):
    """Non-reentrant recomputation with a frozen base (no input requires grad) still trains the adapters."""
    plain, _ = lora_actor(tok)
    batch = train_batch(plain, tok)
    cfg = lora_configs()
    cfg.model.enable_gradient_checkpointing = True
    checkpointed = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
    plain.update_policy(batch)
    checkpointed.update_policy(batch)
    for (name, a), (_, b) in zip(plain.module.named_parameters(), checkpointed.module.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    assert any(".lora_B." in n and p.abs().max() > 0 for n, p in checkpointed.module.named_parameters())


# ---------------------------------------------------------------------- reference = base
def test_reference_is_the_base_model_and_differs_from_the_actor_after_an_update(tok):
    actor, cfg = lora_actor(tok)
    ref = LoraReference(actor, cfg.ref)
    batch = train_batch(actor, tok)
    base64 = tiny_llama(tok, seed=0).double()  # the same initial weights, float64, no adapters
    with torch.no_grad():
        want = naive_logprobs(base64, batch)
    # B = 0 at start: adapters add exactly zero, so actor and reference agree bit for bit
    assert torch.equal(actor.compute_log_prob(batch, calculate_entropy=False)[0], ref.compute_ref_log_prob(batch))
    actor.update_policy(batch)
    got = ref.compute_ref_log_prob(batch)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    actor_lp, _ = actor.compute_log_prob(batch, calculate_entropy=False)
    assert (actor_lp - got).abs().max() > 1e-3  # the adapters are on outside the reference pass
    assert all(not p.requires_grad or ".lora_" in n for n, p in actor.module.named_parameters())


# ---------------------------------------------------------------------- generation
def test_hf_generation_runs_the_adapters(tok):
    actor, _ = lora_actor(tok)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters far from zero, so the adapted model decodes differently from the base
        for name, p in actor.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    greedy = SamplingParams(n=1, temperature=0.0, response_length=8, do_sample=False)
    prompts = tiny_prompt_batch(tok, PROMPTS)
    adapted = actor.rollout.generate(prompts, greedy)["responses"]
    merged = copy.deepcopy(actor.lora.peft).merge_and_unload()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert torch.equal(HFRolloutEngine(merged, tok).generate(prompts, greedy)["responses"], adapted)
    with actor.lora.disabled():
        base = actor.rollout.generate(prompts, greedy)["responses"]
    assert torch.equal(HFRolloutEngine(tiny_llama(tok), tok).generate(prompts, greedy)["responses"], base)
    assert not torch.equal(base, adapted)


def test_worker_generation_merges_the_adapters_and_leaves_the_base_untouched(tok):
    """The actor's generate_sequences decodes with W + scaling * B @ A in one product (no adapter
    products run), the same tokens and log-probs as the adapter path; afterwards the base parameters
    are the same objects with the same bits, and the layers compute unmerged again."""
    actor, _ = lora_actor(tok)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in actor.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    before = base_snapshot(actor.module)
    objects = {n: p for n, p in actor.module.named_parameters() if not p.requires_grad}
    adapter_calls = []
    hooks = [m.register_forward_hook(lambda *_: adapter_calls.append(1))
             for n, m in actor.module.named_modules() if n.endswith("lora_A.default")]
    prompts = tiny_prompt_batch(tok, PROMPTS)
    torch.manual_seed(5)
    merged = actor.generate_sequences(prompts)
    assert adapter_calls == []  # the merged weights did the work
    torch.manual_seed(5)
    unmerged = actor.rollout.generate(prompts, SamplingParams.from_rollout_config(actor.rollout_config))
    assert adapter_calls  # outside the block the adapter path runs again
    for h in hooks:
        h.remove()
    assert torch.equal(merged["responses"], unmerged["responses"])
    torch.testing.assert_close(merged["rollout_log_probs"], unmerged["rollout_log_probs"], rtol=0, atol=1e-5)
    assert changed(before, actor.module) == []
    assert all(p is objects[n] for n, p in actor.module.named_parameters() if not p.requires_grad)


# ---------------------------------------------------------------------- critic
def test_lora_critic_trains_adapters_and_its_value_head(tok):
    cfg = lora_configs()
    cfg.critic.model.lora_rank, cfg.critic.model.lora_alpha = 4, 8
    critic = CriticWorker(cfg.critic, device="cpu", module=value_model_from_lm(tiny_llama(tok)))
    held = {id(p) for group in critic.optimizer.param_groups for p in group["params"]}
    names = {n for n, p in critic.module.named_parameters() if id(p) in held}
    assert {"value_head.weight", "value_head.bias"} <= names
    assert all(".lora_" in n for n in names - {"value_head.weight", "value_head.bias"})
    assert sum(p.numel() for n, p in critic.module.named_parameters() if ".lora_" in n) == ADAPTER_PARAMS
    actor, _ = lora_actor(tok)
    batch = train_batch(actor, tok)
    mask = batch["response_mask"]
    batch.batch["values"] = torch.zeros(mask.shape)
    batch.batch["returns"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    before = base_snapshot(critic.module)
    head = critic.module.value_head.weight.detach().clone()
    critic.update_critic(batch)
    assert changed(before, critic.module) == []
    assert not torch.equal(head, critic.module.value_head.weight)  # the zero-initialised head learned


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_holds_the_adapters_and_resumes_exactly(tok, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    actor, _ = lora_actor(tok)
    batch = train_batch(actor, tok)
    actor.update_policy(batch)
    actor.save_checkpoint(tmp_path / "actor")
    saved = load_file(tmp_path / "actor" / "model.safetensors")
    assert set(saved) == {n for n, p in actor.module.named_parameters() if p.requires_grad}  # no base weights
    # the adapter folder is a peft folder giving the same model
    loaded = PeftModel.from_pretrained(tiny_llama(tok), tmp_path / "actor" / "lora_adapter")
    with torch.no_grad():
        torch.testing.assert_close(full_logits(loaded, batch), full_logits(actor.module, batch), atol=1e-6, rtol=0)
    # a fresh actor on the same base resumes: the next update is identical to the uninterrupted one
    resumed, _ = lora_actor(tok)
    resumed.load_checkpoint(tmp_path / "actor")
    actor.update_policy(batch)
    resumed.update_policy(batch)
    for (n, a), (_, b) in zip(actor.module.named_parameters(), resumed.module.named_parameters()):
        assert torch.equal(a, b), n


def test_checkpoint_on_other_base_weights_is_refused(tok, tmp_path):
    actor, _ = lora_actor(tok)
    actor.save_checkpoint(tmp_path / "actor")
    other, _ = lora_actor(tok, seed=1)  # same architecture, other weights
    with pytest.raises(CheckpointError, match="other base weights"):
        other.load_checkpoint(tmp_path / "actor")
    narrower, _ = lora_actor(tok, targets=["q_proj", "v_proj"])  # same base, other adapters
    with pytest.raises(CheckpointError, match="trainable parameters"):
        narrower.load_checkpoint(tmp_path / "actor")


def test_training_starts_from_a_saved_adapter_folder(tok, tmp_path):
    actor, _ = lora_actor(tok)
    batch = train_batch(actor, tok)
    actor.update_policy(batch)
    actor.save_checkpoint(tmp_path / "actor")
    cfg = lora_configs(rank=0)  # rank, alpha and targets come from the folder (verl's lora_adapter_path)
    cfg.model.lora_adapter_path = str(tmp_path / "actor" / "lora_adapter")
    start = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
    assert torch.equal(start.compute_log_prob(batch)[0], actor.compute_log_prob(batch)[0])
    assert sum(p.numel() for p in start.module.parameters() if p.requires_grad) == ADAPTER_PARAMS


# ---------------------------------------------------------------------- precision, bad input
def test_auto_precision_times_the_lora_model(tok, tmp_path):
    from posttrain.models.compute_dtype import choose_param_dtype, time_train_step

    actor, _ = lora_actor(tok)
    seconds = time_train_step(actor.module, torch.device("cpu"), "fp32", repeats=1)
    assert 0 < seconds < 60
    assert all(p.grad is None for p in actor.module.parameters())
    choice, _ = choose_param_dtype(actor.module, torch.device("cpu"), cache_dir=tmp_path)
    assert choice in ("bf16", "fp32")


@pytest.mark.parametrize("targets, match", [
    (["q_proj", "qkv_proj"], r"\['q_proj', 'qkv_proj'\]: 'qkv_proj' matches no module of LlamaForCausalLM; "
                             r"valid names include: all-linear, down_proj, gate_proj, k_proj, lm_head"),
    ("model\\.layers\\.9\\..*", r"'.*': '.*' matches no module of LlamaForCausalLM; valid names include"),
    (["embed_tokens"], r"\['embed_tokens'\] selects model.embed_tokens \(Embedding\); posttrain's LoRA adapts "
                       r"nn.Linear layers only"),
])
def test_unknown_target_modules_name_the_key_and_valid_names(tok, targets, match):
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.target_modules=" + match):
        lora_actor(tok, targets=targets)


def test_exclude_modules_that_match_nothing_are_refused(tok):
    cfg = lora_configs()
    cfg.model.exclude_modules = ["o_prj"]
    with pytest.raises(ConfigError, match=r"exclude_modules=\['o_prj'\]: 'o_prj' matches no module"):
        ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
    cfg.model.exclude_modules = ["o_proj"]
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
    assert not any("o_proj.lora" in n for n, _ in actor.module.named_parameters())
    assert sum(p.numel() for p in actor.module.parameters() if p.requires_grad) == ADAPTER_PARAMS - 2 * 4 * 128
