"""`posttrain plan` with on-policy distillation: the GRPO blog script (8 GPUs) with a deepseek-7b-shaped teacher,
and two teachers: the teachers' pass, the models and why, the per-step flow line and the memory, checked by hand."""

import pytest

from posttrain.plan import build_plan, resolve_dims
from posttrain.plan.flow import build_flow, uses_models
from posttrain.plan.report import render


def _config(load_script, grpo_script, teacher, *extra):
    return load_script(grpo_script, "distillation.enabled=True",
                       f"distillation.teacher_models.teacher_model.model_path={teacher}", *extra)


def test_the_teachers_pass_models_and_flow_line(grpo_script, deepseek_dir, load_script):
    config = _config(load_script, grpo_script, deepseek_dir, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                     "distillation.distillation_loss.topk=16")
    f = build_flow(config)
    ref = next(p for p in f.forward_passes if p.name == "reference log-prob")
    teacher = next(p for p in f.forward_passes if p.name == "teacher log-prob")
    assert (teacher.micro_batch, teacher.rounds) == (ref.micro_batch, ref.rounds)  # the reference's micro-batches
    assert "its top-16 tokens" in f.distillation and "back-propagated (supervised)" in f.distillation
    assert "plus the task rewards' PPO loss" in f.distillation
    teachers = [m for m in uses_models(config) if m["role"].startswith("teacher")]
    assert teachers == [{"role": "teacher", "loaded": True, "model": str(deepseek_dir),
                         "why": "because distillation.enabled=True: frozen, scores the sampled tokens of every row; "
                                "placed like the reference (actor_rollout_ref.ref.fsdp_config)"}]
    pg = build_flow(_config(load_script, grpo_script, deepseek_dir, "distillation.distillation_loss.loss_mode=k1",
                            "distillation.distillation_loss.use_policy_gradient=True",
                            "distillation.distillation_loss.use_task_rewards=False"))
    assert "its log-prob of every sampled token" in pg.distillation and "advantage of the vanilla PPO loss" in pg.distillation
    assert "task rewards logged, not trained on" in pg.distillation
    assert all(p.name != "teacher log-prob" for p in build_flow(load_script(grpo_script)).forward_passes)  # control


def test_two_teachers_are_each_a_model(grpo_script, deepseek_dir, load_script):
    config = _config(load_script, grpo_script, "null", f"+distillation.teacher_models.g.model_path={deepseek_dir}",
                     "+distillation.teacher_models.g.key=openai/gsm8k", "+distillation.teacher_models.m.key=math",
                     f"+distillation.teacher_models.m.model_path={deepseek_dir}")
    roles = {m["role"]: m for m in uses_models(config) if m["role"].startswith("teacher")}
    assert set(roles) == {"teacher openai/gsm8k", "teacher math"}
    assert "the rows whose data_source is math" in roles["teacher math"]["why"]
    assert "2 teachers, each row's picked by its data_source" in build_flow(config).distillation


def test_teacher_memory_by_hand(grpo_script, deepseek_dir, load_script):
    config = _config(load_script, grpo_script, deepseek_dir)
    dims, why = resolve_dims(config, str(deepseek_dir))
    plan = build_plan(config, dims=dims, dims_reason=why)
    m = plan.memory
    teacher, reference = m.roles["teacher"], m.roles["reference"]
    # the same model as the reference, placed alike (fp32 master weights over the 8 ranks, offloaded as the
    # script offloads the reference's): the same parameters and forward terms
    assert teacher["params"] == pytest.approx(reference["params"])
    assert teacher["params"] == pytest.approx(dims.params * 4 / 8)
    assert teacher["forward_activations"] == reference["forward_activations"]
    phase = next(p for p in m.phases if p.name == "teacher log-prob")
    assert any(t.name.startswith("teacher parameters") for t in phase.terms)
    assert "teacher log-prob" in render(plan) and "teacher" in render(plan).split("Models")[1]
    two = build_plan(_config(load_script, grpo_script, "null", f"+distillation.teacher_models.g.model_path={deepseek_dir}",
                             "+distillation.teacher_models.g.key=a", "+distillation.teacher_models.m.key=b",
                             f"+distillation.teacher_models.m.model_path={deepseek_dir}"), dims=dims).memory
    assert two.roles["teacher"]["params"] == pytest.approx(2 * teacher["params"])  # one copy per teacher
