"""End to end through Ray with 2 CPU ranks (gloo, FSDP2): the trainer's numbers equal one process's,
checkpoints move between world sizes (2 -> 1 and 1 -> 2), and a rank that dies stops the run fast.

PPO runs greedy (so both world sizes see the same responses) with a reward that varies by prompt,
so policy, value and KL losses are all non-zero. Each Ray group costs ~20 s to start on 2 cores
(every rank imports torch and loads its models), so the runs are shared between assertions.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.tiny_run import tiny_config  # noqa: E402

COMPARED = ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm",
            "critic/values/mean", "critic/advantages/mean", "critic/returns/mean", "critic/score/mean")

PPO_GREEDY = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.do_sample=False", "actor_rollout_ref.rollout.n=1",
              "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
              "actor_rollout_ref.actor.use_kl_loss=True", "trainer.total_training_steps=3", "trainer.save_freq=1",
              # the adaptive KL controller's state travels in the checkpoint: its coefficient is compared
              "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05"]


def prompt_length_reward(batch):
    """0, 0.5 or 1 by prompt length: differs between prompts, identical whoever computes it."""
    return (batch["attention_mask"].sum(-1) % 3).float() / 2


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def fit(workdir, ranks: int, extra: list[str]) -> list[dict]:
    from posttrain.trainer.trainer import RLTrainer

    trainer = RLTrainer(tiny_config(workdir, [f"trainer.n_gpus_per_node={ranks}", *extra]))
    trainer.reward_fn = prompt_length_reward
    return trainer.fit()


def assert_same_metrics(run, reference, steps):
    for step in steps:
        got, want = run[step - 1], reference[step - 1]
        assert got["step"] == want["step"] == step
        for key in (k for k in COMPARED if k in want):  # KL-in-reward and critic keys only where used
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5), (step, key, got[key], want[key])


@pytest.fixture(scope="module")
def one_process_ppo(tmp_path_factory):
    work = tmp_path_factory.mktemp("ppo1")
    return work, fit(work, 1, PPO_GREEDY + [f"trainer.default_local_dir={work / 'ckpt'}"])


@pytest.fixture(scope="module")
def two_rank_ppo(tmp_path_factory, ray_cluster):
    work = tmp_path_factory.mktemp("ppo2")
    return work, fit(work, 2, PPO_GREEDY + [f"trainer.default_local_dir={work / 'ckpt'}"])


def test_two_ranks_equal_one_process(one_process_ppo, two_rank_ppo):
    (_, one), (work, two) = one_process_ppo, two_rank_ppo
    assert all(abs(row["actor/pg_loss"]) > 0 or row["step"] == 1 for row in one)  # non-trivial losses
    assert one[-1]["critic/vf_loss"] > 0.1 and one[-1]["actor/kl_loss"] > 0
    assert one[-1]["actor/reward_kl_penalty_coeff"] != 0.05  # the adaptive controller moved: compared below
    assert_same_metrics(two, one, steps=(1, 2, 3))
    assert (work / "ckpt" / "global_step_3" / "actor" / "dcp" / ".metadata").exists()  # saved by the ranks
    for row in two:  # each rank measured its own phases (the driver holds no model: its peak is smaller)
        for rank in (0, 1):
            assert row[f"memory/rank{rank}/peak_resident_gb"] > 0.1  # a process with torch loaded: a real reading
        assert row["memory/ranks/peak_resident_gb"] == max(row["memory/rank0/peak_resident_gb"],
                                                           row["memory/rank1/peak_resident_gb"])
        assert row["memory/ranks/peak_resident_gb"] >= row["memory/ranks/resident_gb/update_actor"] > 0
        assert {"memory/ranks/resident_gb/gen", "memory/ranks/resident_gb/values"} <= row.keys()


def test_exported_weights_equal_one_process(one_process_ppo, two_rank_ppo):
    from transformers import AutoModelForCausalLM

    one = AutoModelForCausalLM.from_pretrained(one_process_ppo[0] / "ckpt" / "hf_model").state_dict()
    two = AutoModelForCausalLM.from_pretrained(two_rank_ppo[0] / "ckpt" / "hf_model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(one_process_ppo[0] / "tiny_model_0").state_dict()
    assert one.keys() == two.keys()
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    assert moved > 1e-3  # training changed the weights, so equality below means something
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_grpo_on_replayed_samples_equals_one_process(tmp_path_factory, ray_cluster):
    """GRPO with sampled responses: the one-process run records its rollouts, the 2-rank run replays
    them (the ranks' own sampling streams differ from one process's), so rewards, group advantages,
    losses and gradient norms must be equal. The ranks also encode each prompt once
    (use_prefix_grouper), the one process every row's own copy: the same numbers either way."""
    from posttrain.trainer.trainer import RLTrainer

    grpo = ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=True", "trainer.total_training_steps=3"]
    recorded = []
    one = RLTrainer(tiny_config(tmp_path_factory.mktemp("grpo1"), ["trainer.n_gpus_per_node=1", *grpo]))
    generate = one.workers.generate_sequences
    one.workers.generate_sequences = lambda prompts, validate=False: recorded.append(generate(prompts)) or recorded[-1]
    one.reward_fn = lambda batch: (batch["responses"] % 3 == 0).float().mean(-1)  # differs between samples
    one_history = one.fit()
    two = RLTrainer(tiny_config(tmp_path_factory.mktemp("grpo2"), ["trainer.n_gpus_per_node=2", *grpo,
                                                                   "actor_rollout_ref.actor.use_prefix_grouper=True"]))
    replay = iter(recorded)
    two.workers.generate_sequences = lambda prompts, validate=False: next(replay)
    two.reward_fn = one.reward_fn
    two_history = two.fit()
    assert all(row["actor/grad_norm"] > 1e-3 and row["critic/advantages/max"] > 0 for row in one_history)  # real signal
    assert_same_metrics(two_history, one_history, steps=(1, 2, 3))


GSM8K_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"
BUDGET = 900  # tokens per micro-batch: GSM8K prompts (char-level tokens) of 250-700 give 1-3 rows each
DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=True", f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
           "critic.use_dynamic_bsz=True", f"critic.ppo_max_token_len_per_gpu={BUDGET}",
           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
           f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={BUDGET}",
           "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
           f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={BUDGET}",
           f"critic.forward_max_token_len_per_gpu={BUDGET}", "actor_rollout_ref.model.use_remove_padding=True",
           "critic.model.use_remove_padding=True", "trainer.save_freq=-1", "trainer.total_training_steps=2",
           "trainer.balance_batch=False", "data.max_prompt_length=1024", "data.filter_overlong_prompts=True",
           "actor_rollout_ref.nccl_timeout=120"]


def micro_batch_counts(lengths, ranks: int) -> list[int]:
    from posttrain.models.microbatch import split_by_tokens

    per_rank = len(lengths) // ranks
    counts = []
    for r in range(ranks):
        mask = torch.zeros(per_rank, max(lengths))
        for i, n in enumerate(lengths[r * per_rank:(r + 1) * per_rank]):
            mask[i, :n] = 1
        counts.append(len(split_by_tokens(mask, BUDGET)))
    return counts


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_token_budget_micro_batches_and_padding_removal_equal_one_process(tmp_path_factory, ray_cluster):
    """Real GSM8K prompts of varied length, token-budget micro-batches (each rank its own count, the
    ranks then agree on the largest) and padding-free forwards: the numbers equal one process's."""
    from posttrain.data.prep import main as prep_main

    data = tmp_path_factory.mktemp("gsm8k")
    assert prep_main(["gsm8k", "--input", str(GSM8K_DIR), "--output", str(data)]) == 0
    files = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}"]
    one_dir = tmp_path_factory.mktemp("dyn1")
    from posttrain.trainer.trainer import RLTrainer

    probe = RLTrainer(tiny_config(one_dir, PPO_GREEDY + DYNAMIC + files))
    lengths = [int(n) + 8 for n in probe.data.train_loader.next_batch()["attention_mask"].sum(-1)]
    assert len(set(micro_batch_counts(lengths, 2))) > 1, lengths  # the ranks really disagree at step 1
    one = fit(one_dir, 1, PPO_GREEDY + DYNAMIC + files)
    two = fit(tmp_path_factory.mktemp("dyn2"), 2, PPO_GREEDY + DYNAMIC + files)
    assert one[-1]["actor/grad_norm"] > 0 and one[-1]["critic/vf_loss"] > 0.1
    assert_same_metrics(two, one, steps=(1, 2))


def test_checkpoint_of_two_ranks_resumes_in_one_process(two_rank_ppo, tmp_path):
    work, two = two_rank_ppo
    resumed = fit(work, 1, PPO_GREEDY + [f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={work / 'ckpt' / 'global_step_1'}"])
    assert [row["step"] for row in resumed] == [2, 3]
    assert_same_metrics([None] + resumed, two, steps=(2, 3))


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_checkpoint_of_one_process_resumes_on_two_ranks(one_process_ppo, ray_cluster, tmp_path):
    work, one = one_process_ppo
    shutil.copytree(work / "tiny_model_0", tmp_path / "tiny_model_0")
    resumed = fit(tmp_path, 2, PPO_GREEDY + ["trainer.resume_mode=resume_path",
                                             f"trainer.resume_from_path={work / 'ckpt' / 'global_step_1'}"])
    assert [row["step"] for row in resumed] == [2, 3]
    assert_same_metrics([None] + resumed, one, steps=(2, 3))


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
@pytest.mark.parametrize("when", ["computing", "saving"])
def test_grpo_runs_and_a_dead_rank_stops_the_run_fast(ray_cluster, tmp_path, when):
    """3 sampled GRPO steps; at step 4 rank 1's process is killed, while the ranks compute (after the
    rollout) or while they save: the run must end with an error naming the rank within 30 s, and the
    checkpoint of step 2 stays the latest, complete, with no half-written folder left."""
    from posttrain.checkpoint import CheckpointManager
    from posttrain.distributed.ray_pool import WorkerGroupError
    from posttrain.trainer.trainer import RLTrainer

    cfg = tiny_config(tmp_path, ["trainer.n_gpus_per_node=2", "trainer.total_training_steps=4", "trainer.save_freq=2",
                                 "actor_rollout_ref.actor.use_kl_loss=True"])
    trainer = RLTrainer(cfg)
    killed_at = {}

    def kill_rank_1():
        ray.kill(trainer.workers._ranks._actors[1])
        killed_at["t"] = time.monotonic()

    def reward(batch):
        if trainer.global_step == 4 and when == "computing":
            kill_rank_1()
        return prompt_length_reward(batch) + torch.rand(len(batch))

    save = trainer.workers.save_checkpoint

    def save_and_die(folder):
        if trainer.global_step == 4:
            kill_rank_1()
        return save(folder)

    trainer.reward_fn = reward
    trainer.workers.save_checkpoint = save_and_die
    with pytest.raises(WorkerGroupError, match="rank 1") as err:
        trainer.fit()
    assert time.monotonic() - killed_at["t"] < 30, err.value
    assert [row["step"] for row in trainer.history] == [1, 2, 3]
    assert all(math.isfinite(row["actor/pg_loss"]) and row["actor/pg_loss"] != 0 for row in trainer.history[1:])
    assert CheckpointManager(tmp_path / "ckpt").latest().name == "global_step_2"
    left = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert [n for n in left if n.startswith(("global_step_", ".tmp_", ".old_", ".trash_"))] == ["global_step_2"], left


def test_gpus_asked_of_a_cpu_cluster_are_refused_naming_the_keys(ray_cluster, tmp_path):
    """trainer.device=cuda with 2 GPUs per node on this CPU machine: one config error before any model
    loads (the driver itself needs no GPU), not a silent wait for resources that never come."""
    from posttrain.config import ConfigError
    from posttrain.trainer.trainer import RLTrainer

    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"trainer\.n_gpus_per_node") as err:
        RLTrainer(tiny_config(tmp_path, ["trainer.n_gpus_per_node=2", "trainer.device=cuda"]))
    assert "GPU" in str(err.value) and time.monotonic() - start < 30
