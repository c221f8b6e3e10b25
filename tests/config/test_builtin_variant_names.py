"""Variants of the built-in run (`posttrain train key=value`) write to folders of their own: the experiment
name, which trainer.default_local_dir and trainer.run_dir follow, names the algorithm, LoRA and rollout
mode, so the asynchronous run never replaces the default run's hf_model/ nor appends to its metrics."""

import pytest

from posttrain.config import BUILTIN_CONFIG, load_config


@pytest.mark.parametrize("overrides, name", [
    ([], "arithmetic_grpo_smollm2"),
    (["algorithm.adv_estimator=gae"], "arithmetic_gae_smollm2"),
    (["actor_rollout_ref.model.lora_rank=32"], "arithmetic_grpo_lora_smollm2"),
    (["trainer.v1.trainer_mode=colocate_async"], "arithmetic_grpo_colocate_async_smollm2"),
    (["trainer.v1.trainer_mode=separate_async"], "arithmetic_grpo_separate_async_smollm2"),
    (["actor_rollout_ref.hybrid_engine=False"], "arithmetic_grpo_async_smollm2"),
    (["trainer.experiment_name=mine", "algorithm.adv_estimator=rloo"], "mine"),  # a name the user gave stays
])
def test_each_variant_of_the_builtin_run_has_its_own_folders(overrides, name):
    config = load_config(overrides=overrides, base=BUILTIN_CONFIG, validate=False)
    t = config.trainer
    assert t.experiment_name == name
    assert (t.default_local_dir, t.run_dir) == (f"checkpoints/posttrain/{name}", f"outputs/posttrain/{name}")
    assert t.rollout_data_dir == f"outputs/posttrain/{name}/rollouts"


def test_a_copy_of_the_builtin_yaml_names_its_variants_alike(tmp_path):
    copy = tmp_path / "my_run.yaml"
    copy.write_text(BUILTIN_CONFIG.read_text())
    config = load_config(copy, ["trainer.v1.trainer_mode=colocate_async"], validate=False)
    assert config.trainer.experiment_name == "arithmetic_grpo_colocate_async_smollm2"
