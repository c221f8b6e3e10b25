"""LoRA runs end to end on the tiny model (one process, CPU, fp32): the policy learns a trivial task
through its adapters alone, resuming is exact, the export merges the adapters into a model that
transformers loads and that decodes like the trained policy, and bad LoRA settings fail at start-up
naming the key.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.checkpoint import CheckpointError, CheckpointManager
from posttrain.config import ConfigError, load_config
from posttrain.rollout import SamplingParams
from posttrain.trainer.trainer import RLTrainer
from helpers.tiny_models import tiny_prompt_batch
from helpers.tiny_run import one_thread, tiny_model_dir, tiny_overrides, tiny_trainer

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _trainer(tmp_path, extra, n_train=64):
    return RLTrainer(load_config(overrides=tiny_overrides(tmp_path, LORA + extra, n_train=n_train)))


# ---------------------------------------------------------------------- learning
def test_lora_grpo_learns_a_trivial_task_through_its_adapters(tmp_path):
    """Reward 1 when the response starts with a digit: 10 of the tiny vocabulary's ~100 tokens, so a
    random model starts near 0.1. Control: the same policy with its adapters disabled (the frozen
    base) stays there.

    The adapters include ``lm_head``: a random tiny Llama's weights have std 0.02, so its logits
    hardly respond to hidden-state changes, and ``all-linear`` (which leaves ``lm_head`` out, as peft
    does) learns this task only slowly (measured: 0.03 -> 0.2 in 15 steps; 0.09 -> 1.0 with lm_head).
    """
    targets = "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"
    trainer = tiny_trainer(tmp_path, LORA + [
        targets, "trainer.total_training_steps=10", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "data.max_response_length=2",
        "actor_rollout_ref.actor.optim.lr=3e-2",
    ])
    digits = torch.tensor(trainer.tokenizer.convert_tokens_to_ids(list("0123456789")))
    trainer.reward_fn = lambda batch: torch.isin(batch["responses"][:, 0], digits).float()
    history = trainer.fit()
    scores = torch.tensor([row["critic/score/mean"] for row in history])
    first, last = scores[:3].mean().item(), scores[-3:].mean().item()
    assert first < 0.3, first
    assert last > 0.8, (first, last, scores.tolist())
    actor = trainer.workers.actor
    prompts = next(iter(trainer.data.train_loader))
    sampling = SamplingParams(n=4, temperature=1.0, response_length=1)
    torch.manual_seed(0)
    adapted = torch.isin(actor.rollout.generate(prompts, sampling)["responses"][:, 0], digits).float().mean()
    with actor.lora.disabled():
        base = torch.isin(actor.rollout.generate(prompts, sampling)["responses"][:, 0], digits).float().mean()
    assert adapted > 0.8 and base < 0.3, (adapted, base)


# ---------------------------------------------------------------------- resume + export
COMPARED = ("actor/", "response_length/", "critic/score")
GRPO = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1", "trainer.save_freq=2",
        "trainer.resume_mode=auto", "actor_rollout_ref.actor.optim.lr=3e-2"]


def _first_token_reward(batch):
    """0, 0.5 or 1 by the first response token's id: a random tiny model samples its ~100 tokens almost
    evenly, so the responses of one prompt score differently and GRPO's advantages are not all 0."""
    return (batch["responses"][:, 0] % 3).float() / 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted: 4 steps. Interrupted: 2 steps (saved at step 2), then a new trainer resumes to 4."""
    full_dir, split_dir = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("split")
    full = _trainer(full_dir, GRPO + ["trainer.total_training_steps=4"])
    full.reward_fn = _first_token_reward
    full_rows = full.fit()
    first = _trainer(split_dir, GRPO + ["trainer.total_training_steps=2"])
    first.reward_fn = _first_token_reward
    first.fit()
    resumed = _trainer(split_dir, GRPO + ["trainer.total_training_steps=4"])
    resumed.reward_fn = _first_token_reward
    resumed_rows = resumed.fit()
    return dict(full=full, full_rows=full_rows, resumed=resumed, resumed_rows=resumed_rows, split_dir=split_dir,
                full_dir=full_dir)


def test_lora_resume_is_exact(runs):
    full_rows, resumed_rows = runs["full_rows"], runs["resumed_rows"]
    assert [r["step"] for r in resumed_rows] == [3, 4]
    for a, b in zip(full_rows[2:], resumed_rows):
        keys = sorted(k for k in a if k.startswith(COMPARED))
        assert len(keys) > 10 and "actor/kl_loss" in keys
        bad = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7)}
        assert bad == {}, f"step {a['step']}: {bad}"
    assert full_rows[2]["actor/kl_loss"] > 0  # the adapters moved the policy away from the reference
    full, resumed = runs["full"].workers.actor.module, runs["resumed"].workers.actor.module
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_holds_adapters_only(runs):
    from safetensors.torch import load_file

    step = CheckpointManager(runs["split_dir"] / "ckpt").latest()
    saved = load_file(step / "actor" / "model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert (step / "actor" / "lora_adapter" / "adapter_config.json").exists()
    assert not (step / "ref").exists()


def test_export_merges_the_adapters_into_a_model_that_decodes_like_the_policy(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.export import export_actor

    trainer = runs["full"]
    actor, tok = trainer.workers.actor, trainer.tokenizer
    out = export_actor(runs["full_dir"] / "ckpt", tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    prompts = tiny_prompt_batch(tok, ["1+1=", "what is 7-5?", "9*9=", "hello"])
    greedy = SamplingParams(n=1, temperature=0.0, response_length=8, do_sample=False)
    from posttrain.rollout.hf import HFRolloutEngine

    policy = actor.rollout.generate(prompts, greedy)["responses"]
    assert torch.equal(HFRolloutEngine(merged, tok).generate(prompts, greedy)["responses"], policy)
    # the adapter folder loads with peft onto the base and gives the trained policy's logits
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(runs["full_dir"]))
    adapted = PeftModel.from_pretrained(base, out / "lora_adapter").eval()
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    with torch.no_grad():
        want = actor.module(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(adapted(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, want, atol=1e-4, rtol=0)


def test_resume_with_other_lora_settings_is_refused(runs, tmp_path):
    ckpt = runs["split_dir"] / "ckpt"
    other = [f"trainer.default_local_dir={ckpt}", "actor_rollout_ref.model.lora_rank=4"]
    with pytest.raises(CheckpointError, match=r"LoRA settings.*'lora_rank': 8.*this run has.*'lora_rank': 4"):
        _trainer(runs["split_dir"], GRPO + ["trainer.total_training_steps=6", *other]).fit()
    # full fine-tuning from a LoRA checkpoint (it holds no base weights), and LoRA from a full one
    with pytest.raises(CheckpointError, match=r"LoRA settings.*'lora_rank': 8.*this run has None"):
        RLTrainer(load_config(overrides=tiny_overrides(  # refused at start-up, before the models load
            runs["split_dir"], GRPO + ["trainer.total_training_steps=6", f"trainer.default_local_dir={ckpt}"])))
    full_ckpt = tmp_path / "full_ckpt"
    RLTrainer(load_config(overrides=tiny_overrides(tmp_path, [
        "trainer.total_training_steps=1", "trainer.save_freq=1", f"trainer.default_local_dir={full_ckpt}"]))).fit()
    with pytest.raises(CheckpointError, match=r"LoRA settings \(.*\)=None, this run has .*'lora_rank': 8"):
        _trainer(tmp_path, GRPO + ["trainer.total_training_steps=2", f"trainer.default_local_dir={full_ckpt}"]).fit()


def test_resume_on_another_base_model_is_refused(runs, tmp_path):
    """Same architecture and vocabulary, other weights (model seed 1): the adapters do not belong to it."""
    ckpt = runs["split_dir"] / "ckpt"
    other_base = tiny_model_dir(tmp_path, seed=1)
    with pytest.raises(CheckpointError, match="LoRA adapters trained on other base weights"):
        _trainer(runs["split_dir"], GRPO + ["trainer.total_training_steps=6", f"trainer.default_local_dir={ckpt}",
                                            f"actor_rollout_ref.model.path={other_base}"]).fit()


def test_export_refuses_a_changed_base_model(runs, tmp_path):
    import json

    from posttrain.trainer.export import export_actor

    step = CheckpointManager(runs["full_dir"] / "ckpt").latest()
    record = json.loads((step / "actor" / "lora_base.json").read_text())
    assert record["model_path"] == str(tiny_model_dir(runs["full_dir"]).resolve())
    copy_dir = tmp_path / "ckpt"
    import shutil

    shutil.copytree(step.parent, copy_dir)
    moved = copy_dir / step.name / "actor" / "lora_base.json"
    record["model_path"] = str(tiny_model_dir(tmp_path, seed=1))
    moved.write_text(json.dumps(record))
    from posttrain.checkpoint import MARKER, _seal  # re-seal the edited copy so only the base differs

    (copy_dir / step.name / MARKER).unlink()
    _seal(copy_dir / step.name, int(step.name.rsplit("_", 1)[1]), ["actor"])
    with pytest.raises(CheckpointError, match="not the one the LoRA adapters .* were trained on"):
        export_actor(copy_dir / step.name, tmp_path / "hf")


# ---------------------------------------------------------------------- bad input, at start-up
@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.lora_rank=-1 must be >= 0"),
    ("actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.lora_alpha=0 must be > 0"),
    ("actor_rollout_ref.model.lora_alpha=-8", "actor_rollout_ref.model.lora_alpha=-8 must be > 0"),
    ("actor_rollout_ref.model.target_modules=[]", "actor_rollout_ref.model.target_modules=[] must be all-linear, a list"),
    ("actor_rollout_ref.model.lora_adapter_path=/no/such/adapter",
     "actor_rollout_ref.model.lora_adapter_path=/no/such/adapter: /no/such/adapter does not exist"),
    ("critic.model.lora_alpha=0", None),  # the critic is not used (grpo): its keys are not checked
])
def test_bad_lora_settings_are_config_errors_naming_the_key(tmp_path, override, fragment):
    overrides = tiny_overrides(tmp_path, LORA + [override])
    if fragment is None:
        load_config(overrides=overrides)
        return
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert fragment in str(err.value)


def test_adapter_path_that_is_not_an_adapter_folder(tmp_path):
    model_dir = tiny_model_dir(tmp_path)  # a model folder, not a peft adapter folder
    with pytest.raises(ConfigError, match=rf"lora_adapter_path={model_dir}: {model_dir} holds no adapter_config.json"):
        load_config(overrides=tiny_overrides(tmp_path, [f"actor_rollout_ref.model.lora_adapter_path={model_dir}"]))


def test_unknown_target_module_fails_before_any_weights_load(tmp_path, monkeypatch):
    """The module names are checked on the model's structure built on the meta device."""
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the LoRA check")

    for where in ("posttrain.workers.prepare.load_causal_lm", "posttrain.workers.prepare.load_value_model"):
        monkeypatch.setattr(where, no_weights)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.target_modules=\['q_proj', 'qv_proj'\]: "
                                          r"'qv_proj' matches no module of LlamaForCausalLM; valid names include: "
                                          r"all-linear, down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"):
        _trainer(tmp_path, ["actor_rollout_ref.model.target_modules=[q_proj,qv_proj]"])
    with pytest.raises(ConfigError, match=r"critic.model.target_modules=\['value_proj'\]: 'value_proj' matches no"):
        _trainer(tmp_path, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                            "critic.model.lora_rank=4", "critic.model.target_modules=[value_proj]"])


def test_ppo_with_lora_actor_and_critic_resumes_exactly(tmp_path):
    """GAE with a LoRA critic: its checkpoint holds adapters + value head, and resuming is exact."""
    ppo = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "critic.model.lora_rank=4",
           "critic.model.lora_alpha=8", "critic.optim.lr=3e-2", "trainer.save_freq=2", "trainer.resume_mode=auto"]
    full = _trainer(tmp_path / "full", ppo + ["trainer.total_training_steps=3"])
    full.reward_fn = _first_token_reward
    full_rows = full.fit()
    first = _trainer(tmp_path / "split", ppo + ["trainer.total_training_steps=2"])
    first.reward_fn = _first_token_reward
    first.fit()
    resumed = _trainer(tmp_path / "split", ppo + ["trainer.total_training_steps=3"])
    resumed.reward_fn = _first_token_reward
    (row,) = resumed.fit()
    want = full_rows[2]
    keys = [k for k in want if k.startswith(("critic/vf", "critic/values", "actor/pg_loss", "critic/grad_norm"))]
    assert len(keys) >= 4 and want["critic/vf_loss"] > 0
    for key in keys:
        assert math.isclose(row[key], want[key], rel_tol=1e-5, abs_tol=1e-7), (key, row[key], want[key])
    from safetensors.torch import load_file

    saved = load_file(CheckpointManager(tmp_path / "split" / "ckpt").latest() / "critic" / "model.safetensors")
    assert {"value_head.weight", "value_head.bias"} <= set(saved)
    assert all(".lora_" in k for k in set(saved) - {"value_head.weight", "value_head.bias"})
