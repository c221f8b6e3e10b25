"""A rollout worker's console output (issue 59): it says its own role, not a trainer's memory plan."""

from __future__ import annotations

from helpers.tiny_run import tiny_config
from posttrain.distributed import rollout_pool


def test_the_rollout_worker_says_its_own_role(tmp_path, capsys):
    config = tiny_config(tmp_path, ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1"])
    actor = rollout_pool._build_actor(config, "cpu", 3)  # what RolloutWorker.__init__ builds in its Ray actor
    out = capsys.readouterr().out
    assert "memory plan:" not in out  # the trainer's line (its optimizer's moments, its reference)
    role = [line for line in out.splitlines() if line.startswith("rollout worker 3: ")]
    assert len(role) == 1 and "generates with the actor's weights on cpu" in role[0] and "trains nothing" in role[0]
    assert actor.module is not None  # still the actor, built as the trainer builds its own
