"""verl 0.9.1's `distillation.*` tree: every key of its distillation.yaml with verl's default, teachers routed by
key as verl routes them, and one clear line per bad input (before any model loads)."""

import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError, find_problems, load_config
from posttrain.config.distillation import (DistillationConfig, DistillationLossConfig, TeacherInferenceConfig,
                                           TeacherModelConfig, resolve_teachers, teacher_specs)
from posttrain.config.docs import all_keys

BASE = ["trainer.n_gpus_per_node=1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "distillation.enabled=True", "distillation.teacher_models.teacher_model.model_path=/some/teacher"]

# verl 0.9.1's verl/trainer/config/_generated_ppo_trainer.yaml, `distillation:` (the keys and their defaults)
VERL_LOSS = {"loss_mode": "k3", "topk": 32, "use_task_rewards": True, "distillation_loss_coef": 1.0,
             "loss_max_clamp": None, "log_prob_min_clamp": None, "use_policy_gradient": False,
             "policy_loss_mode": "vanilla", "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
VERL_INFERENCE = {"gpu_memory_utilization": 0.5, "enforce_eager": True, "cudagraph_capture_sizes": None,
                  "free_cache_engine": True, "data_parallel_size": 1, "expert_parallel_size": 1,
                  "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192, "max_model_len": None,
                  "max_num_seqs": 1024, "load_format": "auto", "engine_kwargs": {}, "limit_images": None,
                  "enable_chunked_prefill": True, "enable_prefix_caching": True, "disable_log_stats": True,
                  "skip_tokenizer_init": True}
VERL_FOLLOWING = {"name": "actor_rollout_ref.rollout.name", "dtype": "actor_rollout_ref.rollout.dtype",
                  "prompt_length": "actor_rollout_ref.rollout.prompt_length",
                  "response_length": "actor_rollout_ref.rollout.response_length",
                  "temperature": "actor_rollout_ref.rollout.temperature"}


def _problems(overrides):
    return find_problems(load_config(overrides=BASE + list(overrides), validate=False))[0]


def test_every_verl_key_with_verls_default():
    config = load_config(validate=False)
    d = config.distillation
    assert (d.enabled, d.n_gpus_per_node, d.nnodes, d.teacher_key) == (False, 8, 0, "data_source")
    assert {k: getattr(d.distillation_loss, k) for k in VERL_LOSS} == VERL_LOSS
    assert list(d.teacher_models) == ["teacher_model"]
    keys = all_keys()
    for name in ["enabled", "n_gpus_per_node", "nnodes", "teacher_models", "teacher_key",
                 *(f"distillation_loss.{k}" for k in VERL_LOSS)]:
        assert keys[f"distillation.{name}"].doc, name
    # a teacher entry holds verl's keys, its inference section every key of verl's yaml, each documented
    entry = resolve_teachers(load_config(overrides=["distillation.teacher_models.teacher_model.model_path=/t"],
                                         validate=False))["default"]
    assert {k: getattr(entry.inference, k) for k in VERL_INFERENCE} == VERL_INFERENCE
    assert (entry.key, entry.model_path, entry.num_replicas) == ("default", "/t", 0)
    for key, follows in VERL_FOLLOWING.items():  # verl: ${oc.select:actor_rollout_ref.rollout.<key>}
        value = config
        for part in follows.split("."):
            value = getattr(value, part)
        assert getattr(entry.inference, key) == value, key
    from posttrain.config.docs import field_docs

    for cls in (DistillationConfig, DistillationLossConfig, TeacherModelConfig, TeacherInferenceConfig):
        import dataclasses

        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_the_base_distillation_run_is_valid():
    assert _problems([]) == []
    load_config(overrides=BASE)


@pytest.mark.parametrize("overrides, message", [
    (["distillation.distillation_loss.topk=0"],
     "distillation.distillation_loss.topk=0 must be a positive number of teacher tokens"),
    (["distillation.distillation_loss.topk=-3", "distillation.distillation_loss.loss_mode=forward_kl_topk"],
     "distillation.distillation_loss.topk=-3 must be a positive number of teacher tokens"),
    (["distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=null"],
     "loss_mode=forward_kl_topk needs the teacher's top-k"),
    (["distillation.distillation_loss.loss_mode=k4"], "loss_mode='k4' is not one of"),
    (["distillation.distillation_loss.loss_mode=k1"], "gradient of k1 does not depend on the teacher"),
    (["distillation.distillation_loss.policy_loss_mode=gspo"], "vanilla PPO loss only"),
    (["distillation.distillation_loss.loss_max_clamp=0"], "loss_max_clamp=0.0 must be > 0"),
    (["distillation.distillation_loss.log_prob_min_clamp=3"], "log_prob_min_clamp=3.0 must be"),
    (["distillation.teacher_models.teacher_model.model_path=null"],
     "distillation.teacher_models.teacher_model.model_path is not set"),
    (["+distillation.teacher_models.teacher_model.modle_path=/x"],
     "unknown config key 'distillation.teacher_models.teacher_model.modle_path'"),
    (["distillation.teacher_models.teacher_model.model_path=null", "+distillation.teacher_models.a.key=gsm8k",
      "+distillation.teacher_models.a.model_path=/a", "+distillation.teacher_models.b.model_path=/b"],
     "distillation.teacher_models.b.key is not set"),
    (["+distillation.teacher_models.a.key=gsm8k", "+distillation.teacher_models.a.model_path=/a"],
     "distillation.teacher_models.teacher_model.model_path=/some/teacher is set beside other teachers"),
    (["actor_rollout_ref.hybrid_engine=False"], "the asynchronous trainer does not distil"),
])
def test_one_line_per_bad_input(overrides, message):
    problems = [p for p in _problems(overrides) if "distillation" in p]  # (hybrid_engine=False has its own too)
    assert len(problems) == 1, problems
    assert message in problems[0]


def test_disabled_distillation_checks_nothing():
    config = load_config(overrides=["distillation.distillation_loss.topk=0"], validate=False)
    assert not [p for p in find_problems(config)[0] if "distillation" in p]
    assert teacher_specs(config) is None


def test_several_teachers_are_routed_by_their_key_as_in_verl():
    config = load_config(overrides=BASE[:-1] + [
        "+distillation.teacher_models.arith.key=arithmetic", "+distillation.teacher_models.arith.model_path=/a",
        "+distillation.teacher_models.math.key=lighteval/MATH", "+distillation.teacher_models.math.model_path=/m",
        "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8"])
    teachers = resolve_teachers(config)
    assert {k: t.model_path for k, t in teachers.items()} == {"arithmetic": "/a", "lighteval/MATH": "/m"}
    specs = teacher_specs(config)
    assert {k: m.path for k, m in specs.models.items()} == {"arithmetic": "/a", "lighteval/MATH": "/m"}
    assert specs.topk == 8 and specs.teacher_key == "data_source"
    assert specs.models["arithmetic"].trust_remote_code == config.actor_rollout_ref.model.trust_remote_code
    # a YAML file gives the same tree (entries merged beside the default one, which is dropped)
    yaml = ("distillation:\n  enabled: true\n  teacher_models:\n    arith: {key: arithmetic, model_path: /a}\n"
            "    math: {key: lighteval/MATH, model_path: /m}\n")
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "run.yaml"
    path.write_text(yaml)
    from_file = load_config(path=path, overrides=BASE[:-2], validate=False)
    assert {k: t.model_path for k, t in resolve_teachers(from_file).items()} == {"arithmetic": "/a",
                                                                                 "lighteval/MATH": "/m"}


def test_duplicate_teacher_keys_are_refused():
    problems = _problems(["distillation.teacher_models.teacher_model.model_path=null",
                          "+distillation.teacher_models.a.key=x", "+distillation.teacher_models.a.model_path=/a",
                          "+distillation.teacher_models.b.key=x", "+distillation.teacher_models.b.model_path=/b"])
    assert problems == ["distillation.teacher_models.b.key='x': another teacher has that key"]


def test_warnings_say_what_differs_here():
    config = load_config(overrides=BASE + ["distillation.nnodes=1", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                           "distillation.distillation_loss.use_policy_gradient=True"], validate=False)
    errors, warnings = find_problems(config)
    assert errors == []
    assert any("places the teacher on the student's ranks" in w for w in warnings)
    assert any("top-k signal is mostly unused" in w for w in warnings)
