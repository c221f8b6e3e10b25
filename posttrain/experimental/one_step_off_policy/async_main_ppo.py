"""``python -m posttrain.experimental.one_step_off_policy.async_main_ppo key=value ...`` (verl's module with
``verl`` -> ``posttrain``): a separate rollout pool one weight version behind the trainer, weights pushed
after every update. Its defaults (overridable): hybrid_engine=False, one rollout worker,
staleness_threshold=1, trigger_parameter_sync_step=1."""

from __future__ import annotations

from posttrain.experimental.entry import entry_main, run_as_script

PROG = "python -m posttrain.experimental.one_step_off_policy.async_main_ppo"
DEFAULTS = ("actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1")


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, DEFAULTS, argv)


if __name__ == "__main__":
    run_as_script(PROG, DEFAULTS)
