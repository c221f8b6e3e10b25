"""``python -m posttrain.experimental.fully_async_policy.fully_async_main key=value ...`` (verl's module with
``verl`` -> ``posttrain``): the rollout pool streams work units of data.gen_batch_size prompts, samples may
lag by ceil(async_training.staleness_threshold) versions, weights are pushed every
async_training.trigger_parameter_sync_step updates. Its defaults (overridable) are verl's fully-async yaml's
(staleness_threshold=0.1, trigger_parameter_sync_step=4) except partial_rollout=False (only the hf engine can
pause a generation: set async_training.partial_rollout=True with it), with hybrid_engine=False and one rollout
worker."""

from __future__ import annotations

from posttrain.experimental.entry import entry_main, run_as_script

PROG = "python -m posttrain.experimental.fully_async_policy.fully_async_main"
DEFAULTS = ("actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "async_training.staleness_threshold=0.1", "async_training.trigger_parameter_sync_step=4",
            "async_training.partial_rollout=False")


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, DEFAULTS, argv)


if __name__ == "__main__":
    run_as_script(PROG, DEFAULTS)
