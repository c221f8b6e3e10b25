"""Start-up errors of asynchronous rollouts (issue 39): each bad setting is one line naming the key and
what would be valid, through load_config, `posttrain train` and the verl-named entry points."""

from __future__ import annotations

import pytest

from helpers.tiny_run import tiny_overrides
from posttrain.config import ConfigError, find_problems, load_config

ASYNC = ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1"]


def _only_error(tmp_path, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=tiny_overrides(tmp_path, overrides))
    message = str(info.value)
    assert "\n" not in message, message  # exactly one problem, on one line
    return message


@pytest.mark.parametrize("overrides, needles", [
    (["async_training.staleness_threshold=0.5"],
     ["async_training.staleness_threshold", "actor_rollout_ref.hybrid_engine=True", "hybrid_engine=False"]),
    (["actor_rollout_ref.rollout.n_gpus_per_node=2"], ["actor_rollout_ref.rollout.n_gpus_per_node", "hybrid_engine=True"]),
    (["actor_rollout_ref.hybrid_engine=False"], ["actor_rollout_ref.rollout.n_gpus_per_node=0 = 0 devices", ">= 1"]),
    ([*ASYNC, "actor_rollout_ref.rollout.nnodes=0"], ["actor_rollout_ref.rollout.nnodes=0", ">= 1"]),
    ([*ASYNC, "async_training.staleness_threshold=-0.5"], ["async_training.staleness_threshold=-0.5", ">= 0"]),
    ([*ASYNC, "async_training.staleness_threshold=.nan"], ["async_training.staleness_threshold=nan", "finite"]),
    ([*ASYNC, "async_training.staleness_threshold=.inf"], ["async_training.staleness_threshold=inf", "finite"]),
    ([*ASYNC, "async_training.trigger_parameter_sync_step=0"], ["async_training.trigger_parameter_sync_step=0", ">= 1"]),
    ([*ASYNC, "async_training.partial_rollout=True", "actor_rollout_ref.rollout.name=vllm"],
     ["async_training.partial_rollout=True", "actor_rollout_ref.rollout.name=vllm cannot", "partial_rollout=False",
      "rollout.name=hf"]),
    ([*ASYNC, "async_training.use_rollout_log_probs=False"],
     ["use_rollout_log_probs=False", "compute_prox_log_prob=False", "compute_prox_log_prob=True"]),
    ([*ASYNC, "actor_rollout_ref.rollout.calculate_log_probs=False"],
     ["actor_rollout_ref.rollout.calculate_log_probs=False", "set it to True"]),
    ([*ASYNC, "data.gen_batch_size=3"], ["data.gen_batch_size=3", "must divide data.train_batch_size=4"]),
])
def test_each_bad_setting_is_one_error_naming_its_key(tmp_path, overrides, needles):
    message = _only_error(tmp_path, overrides)
    for needle in needles:
        assert needle in message, message


def test_valid_async_settings_load(tmp_path):
    """Negative control for the errors above: the same keys with valid values load."""
    config = load_config(overrides=tiny_overrides(tmp_path, [*ASYNC, "async_training.staleness_threshold=0.5",
                                                             "async_training.trigger_parameter_sync_step=2",
                                                             "async_training.compute_prox_log_prob=True",
                                                             "data.gen_batch_size=2",
                                                             "async_training.partial_rollout=True"]))
    assert config.async_training.staleness_threshold == 0.5 and config.async_training.partial_rollout


def test_partial_rollout_with_staleness_zero_is_a_warning(tmp_path):
    config = load_config(overrides=tiny_overrides(tmp_path, [*ASYNC, "async_training.partial_rollout=True",
                                                             "async_training.staleness_threshold=0"]))
    errors, warnings = find_problems(config)
    assert not errors
    assert any("partial_rollout=True has no effect" in w for w in warnings), warnings


def test_budget_arithmetic():
    from posttrain.config.async_training import AsyncTrainingConfig, max_lag, window_batches

    assert [max_lag(s) for s in (0, 0.1, 1, 1.5, 2)] == [0, 1, 1, 2, 2]
    cases = {(0, 1, 1): 1, (1, 1, 1): 2, (0.1, 4, 1): 5, (0.5, 4, 2): 12, (0, 4, 1): 4}
    for (s, t, r), want in cases.items():
        cfg = AsyncTrainingConfig(staleness_threshold=s, trigger_parameter_sync_step=t, require_batches=r)
        assert window_batches(cfg) == want, (s, t, r)


def test_entry_points_and_posttrain_train_report_one_line(tmp_path, capsys, monkeypatch):
    from posttrain.cli import main as posttrain_main
    from posttrain.experimental.fully_async_policy import fully_async_main
    from posttrain.experimental.one_step_off_policy import async_main_ppo

    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    base = tiny_overrides(tmp_path)
    runs = [(async_main_ppo.main, ["async_training.trigger_parameter_sync_step=0"],
             "async_training.trigger_parameter_sync_step=0"),
            (fully_async_main.main, ["async_training.partial_rollout=True", "actor_rollout_ref.rollout.name=vllm"],
             "async_training.partial_rollout=True"),
            (lambda argv: posttrain_main(["train", *argv]), ["async_training.staleness_threshold=2"],
             "actor_rollout_ref.hybrid_engine=True")]
    for entry, bad, needle in runs:
        rc = entry([*base, *bad])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and lines[-1].startswith("error: ") and needle in lines[-1], err
        assert "Traceback" not in err


def test_more_rollout_workers_than_the_cluster_holds(tmp_path):
    ray = pytest.importorskip("ray")
    from posttrain.distributed.cluster import ClusterResourceError
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    config = load_config(overrides=tiny_overrides(tmp_path, ["actor_rollout_ref.hybrid_engine=False",
                                                             "actor_rollout_ref.rollout.n_gpus_per_node=3"]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ClusterResourceError) as info:
            AsyncRLTrainer(config)
    finally:
        ray.shutdown()
    message = str(info.value)
    assert "\n" not in message
    assert "actor_rollout_ref.rollout.n_gpus_per_node=3 rollout workers plus 1 trainer device(s)" in message


def test_plan_names_the_pools_the_budget_and_partial_rollouts(tmp_path):
    from posttrain.plan.flow import async_pools

    plain = load_config(overrides=tiny_overrides(tmp_path, [*ASYNC, "async_training.staleness_threshold=1"]))
    text = async_pools(plain)
    assert "rollout pool 1 x 1 = 1 hf worker(s)" in text and "samples may lag <= 1 weight version(s)" in text
    assert "at most 2 train batch(es)" in text and "partial" not in text
    partial = load_config(overrides=tiny_overrides(tmp_path, [*ASYNC, "async_training.staleness_threshold=1",
                                                              "async_training.partial_rollout=True"]))
    assert async_pools(partial).endswith("partial rollouts: a push lands between two decoding steps")
    assert async_pools(load_config(overrides=tiny_overrides(tmp_path))) is None  # colocated: no pools
