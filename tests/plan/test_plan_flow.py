"""The batch flow of the two blog scripts, checked by hand (8 GPUs, one node, GSM8K's 7473 prompts)."""

from pathlib import Path

import pytest

from posttrain.plan.flow import GSM8K_TRAIN_SIZE, build_flow, dataset_size, uses_models


def test_grpo_flow_by_hand(grpo_script, load_script):
    f = build_flow(load_script(grpo_script))
    assert (f.world_size, f.dp_size) == (8, 8)
    # 1024 prompts x n=5 = 5120 responses; / 8 ranks = 640 per rank
    assert (f.prompts_per_step, f.responses_per_step, f.responses_per_rank) == (1024, 5120, 640)
    # vllm, TP 2 requested but not applied: one engine per rank, 8 engines of 5120 / 8 = 640 responses = 128 prompts x 5
    assert (f.rollout_tp_requested, f.rollout_tp) == (2, 1)
    assert (f.rollout_workers, f.responses_per_worker, f.prompts_per_worker) == (8, 640, 128)
    # 5120 x (512 + 1024) tokens at most
    assert f.max_tokens_per_step == 5120 * 1536 == 7_864_320
    # old log-prob and reference: 640 / 160 = 4 rounds each; no critic pass
    assert [(p.name, p.micro_batch, p.rounds) for p in f.forward_passes] == [
        ("old log-prob (actor)", 160, 4), ("reference log-prob", 160, 4)]
    a = f.actor
    # mini-batch 256 prompts x 5 = 1280 responses / 8 = 160 per rank; 640 / 160 = 4 mini-batches = 4 optimizer steps
    assert (a.mini_batch_responses, a.mini_batch_per_rank, a.mini_batches, a.optimizer_steps) == (1280, 160, 4, 4)
    # micro 80: 160 / 80 = 2 accumulation steps; 640 / 80 = 8 forward/backward passes per rank
    assert (a.micro_batch, a.grad_accum, a.forward_backward) == (80, 2, 8)
    assert f.critic is None
    # 7473 // 1024 = 7 steps per epoch (last partial batch dropped) x 15 epochs = 105
    assert (f.dataset_size, f.steps_per_epoch, f.total_steps) == (7473, 7, 105)
    assert "assumed" in f.dataset_note and f.size_error is None


def test_ppo_flow_by_hand(ppo_script, load_script):
    f = build_flow(load_script(ppo_script))
    # n = 1: 1024 responses, 128 per rank; vllm TP 4 requested, one engine per rank: 8 engines of 128
    assert (f.responses_per_step, f.responses_per_rank, f.rollout_workers, f.responses_per_worker) == (1024, 128, 8, 128)
    # log-prob micro 32: 128 / 32 = 4 rounds; critic values use its ppo micro (32) -> 4 rounds; no reference
    assert [(p.name, p.rounds) for p in f.forward_passes] == [("old log-prob (actor)", 4), ("critic values", 4)]
    # actor: 256 x 1 / 8 = 32 per rank, micro 16 -> accumulation 2; 128 / 32 = 4 optimizer steps
    assert (f.actor.mini_batch_per_rank, f.actor.grad_accum, f.actor.optimizer_steps, f.actor.forward_backward) == (32, 2, 4, 8)
    # critic follows the actor's mini-batch (32 per rank) with micro 32 -> no accumulation
    assert (f.critic.mini_batch_per_rank, f.critic.micro_batch, f.critic.grad_accum, f.critic.optimizer_steps) == (32, 32, 1, 4)
    assert f.total_steps == 105


def test_sequence_parallel_and_epochs(grpo_script, load_script):
    c = load_script(grpo_script, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                    "actor_rollout_ref.actor.ppo_epochs=2", "trainer.total_training_steps=50")
    f = build_flow(c)
    # 8 ranks / SP 2 = 4 data-parallel ranks: 5120 / 4 = 1280 responses each; mini 1280 / 4 = 320 per rank
    assert (f.dp_size, f.responses_per_rank, f.actor.mini_batch_per_rank) == (4, 1280, 320)
    # 1280 / 320 = 4 mini-batches x 2 epochs = 8 optimizer steps; an explicit step count wins
    assert (f.actor.mini_batches, f.actor.optimizer_steps) == (4, 8)
    assert (f.total_steps, f.total_steps_note) == (50, "trainer.total_training_steps")


def test_size_error_keeps_the_rest(grpo_script, load_script):
    f = build_flow(load_script(grpo_script, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"))
    assert f.actor is None and "not divisible" in f.size_error
    assert f.responses_per_step == 5120  # what does not depend on the error is still there


def test_dataset_size_counts_local_files(tmp_path, grpo_script, load_script):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"q": 1}\n{"q": 2}\n\n{"q": 3}\n')
    c = load_script(grpo_script, f"data.train_files={rows}")
    assert dataset_size(c)[0] == 3
    assert dataset_size(c, given=2048) == (2048, "given by --train-size")
    c = load_script(grpo_script, "data.train_files=/nowhere/prompts.parquet")
    assert dataset_size(c)[0] is None and build_flow(c).steps_per_epoch is None


def test_real_gsm8k_file_has_the_assumed_size(grpo_script, load_script):
    path = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip("GSM8K copy not present")
    assert dataset_size(load_script(grpo_script, f"data.train_files={path}"))[0] == GSM8K_TRAIN_SIZE


def test_models_and_why(ppo_script, grpo_script, load_script):
    grpo = {m["role"]: m for m in uses_models(load_script(grpo_script))}
    assert grpo["reference"]["loaded"] and grpo["reference"]["why"].startswith("because actor.use_kl_loss=True")
    assert not grpo["critic"]["loaded"] and "grpo is critic-free" in grpo["critic"]["why"]
    ppo = {m["role"]: m for m in uses_models(load_script(ppo_script))}
    assert ppo["critic"]["loaded"] and "adv_estimator=gae" in ppo["critic"]["why"]
    assert not ppo["reference"]["loaded"] and not ppo["reward model"]["loaded"]
    both = {m["role"]: m for m in uses_models(load_script(grpo_script, "algorithm.use_kl_in_reward=True"))}
    assert "use_kl_loss=True" in both["reference"]["why"] and "use_kl_in_reward=True" in both["reference"]["why"]


def test_multi_turn_budget_line():
    from posttrain.config import load_config

    example = str(Path(__file__).parents[2] / "examples" / "multiply_tool.yaml")
    on = load_config(example, ["actor_rollout_ref.rollout.multi_turn.max_user_turns=2"])
    line = build_flow(on).multi_turn
    assert line.startswith("multi-turn: at most 3 assistant turns and at most 2 tool/user turns per trajectory")
    assert "96-token response" in line and "cut to 256 characters (middle)" in line
    off = load_config(example, ["actor_rollout_ref.rollout.multi_turn.enable=False"])
    assert build_flow(off).multi_turn is None


def test_a_rank_with_fewer_responses_than_a_micro_batch_runs_one_smaller_round():
    from posttrain.config import BUILTIN_CONFIG, load_config

    # the built-in run: 8 prompts x 4 = 32 responses; on 2 ranks 16 each, under the micro-batch of 32
    f = build_flow(load_config(overrides=["trainer.n_gpus_per_node=2"], base=BUILTIN_CONFIG))
    assert f.responses_per_rank == 16
    assert ("reference log-prob", 16, 1) in [(p.name, p.micro_batch, p.rounds) for p in f.forward_passes]
    one = build_flow(load_config(base=BUILTIN_CONFIG))  # one process: all 32 in one round of 32
    assert ("reference log-prob", 32, 1) in [(p.name, p.micro_batch, p.rounds) for p in one.forward_passes]
