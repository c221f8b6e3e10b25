"""On-policy distillation on 2 CPU ranks (Ray, gloo, FSDP2) gives one process's numbers: two teachers, each
sharded over both ranks, routed by a column of the data (``distillation.teacher_key``), the top-k loss beside the
task rewards' PPO loss. Greedy, so both world sizes see the same responses; the rows of one teacher are split
unevenly over the ranks (a rank may hold none of a teacher's rows and still runs its collectives)."""

from __future__ import annotations

import math

import pytest

ray = pytest.importorskip("ray")

from helpers.tiny_run import tiny_config, tiny_model_dir, tiny_overrides  # noqa: E402

COMPARED = ("distillation/loss", "distillation/reverse_kl", "distillation/teacher_log_prob",
            "distillation/student_log_prob", "distillation/teacher_mass", "distillation/student_mass",
            "actor/pg_loss", "actor/grad_norm")


def _routed_data(workdir) -> str:
    """The tiny task's training rows with a ``teacher`` column: A for the first three of every eight, else B."""
    import pandas as pd

    tiny_overrides(workdir)  # writes the data once
    frame = pd.read_parquet(workdir / "data" / "train.parquet")
    frame["teacher"] = ["A" if i % 8 < 3 else "B" for i in range(len(frame))]
    path = workdir / "data" / "routed.parquet"
    frame.to_parquet(path)
    return str(path)


def distil(workdir, ranks: int) -> list[dict]:
    from posttrain.trainer.trainer import RLTrainer

    overrides = [f"trainer.n_gpus_per_node={ranks}", "actor_rollout_ref.rollout.do_sample=False",
                 "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8", "data.shuffle=False",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
                 "trainer.total_training_steps=2", "algorithm.adv_estimator=reinforce_plus_plus",
                 f"data.train_files={_routed_data(workdir)}", "distillation.enabled=True",
                 "distillation.teacher_key=teacher", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                 "distillation.distillation_loss.topk=4", "distillation.distillation_loss.distillation_loss_coef=0.5",
                 "distillation.teacher_models.teacher_model.model_path=null",
                 "+distillation.teacher_models.a.key=A", f"+distillation.teacher_models.a.model_path={tiny_model_dir(workdir, 1)}",
                 "+distillation.teacher_models.b.key=B", f"+distillation.teacher_models.b.model_path={tiny_model_dir(workdir, 2)}"]
    return RLTrainer(tiny_config(workdir, overrides)).fit()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a 2-rank engine run (~30-60 s on 2 cores): `python -m pytest -m slow`
def test_two_ranks_distil_like_one_process(tmp_path_factory, ray_cluster):
    one = distil(tmp_path_factory.mktemp("opd1"), 1)
    two = distil(tmp_path_factory.mktemp("opd2"), 2)
    assert one[0]["distillation/loss"] > 0 and one[0]["actor/grad_norm"] > 0  # real numbers to compare
    for got, want in zip(two, one):
        assert got["step"] == want["step"]
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5), (got["step"], key, got[key], want[key])
