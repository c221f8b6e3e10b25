"""On-policy distillation end to end on tiny models: each variant moves the student towards its teacher, the
batch carries the teacher's scores, and every bad input is one line before any model loads."""

from __future__ import annotations

import pytest

from helpers.tiny_run import one_thread, tiny_config, tiny_model_dir
from posttrain.config import ConfigError
from posttrain.trainer.trainer import RLTrainer

LEARN = ["trainer.total_training_steps=8", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.actor.optim.lr=3e-3", "distillation.enabled=True",
         "distillation.distillation_loss.use_task_rewards=False"]


def _teacher(tmp_path):
    return f"distillation.teacher_models.teacher_model.model_path={tiny_model_dir(tmp_path, seed=1)}"


def _peaked_teacher(tmp_path, token: str = "7", weight: float = 0.6):
    """A tiny teacher that favours one token everywhere (its logit raised by ~8 x ``weight``: p ~ 0.4), so the
    student's reverse KL to it starts large and its fall is the student learning, not noise. Dimension 0 of
    the residual stream is held at 1 (eos_biased_tiny_llama's construction), read by that token's output row."""
    import torch

    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    folder = tmp_path / "peaked_teacher"
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok, seed=1)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tok.convert_tokens_to_ids(token), 0] = weight
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return f"distillation.teacher_models.teacher_model.model_path={folder}"


@pytest.mark.parametrize("variant, factor", [
    # the supervised k3 gradient on one sampled token is the weakest signal: a larger step, a smaller fall
    (["distillation.distillation_loss.loss_mode=k3", "actor_rollout_ref.actor.optim.lr=6e-3"], 0.95),  # 0.610 -> 0.565
    (["distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=True"],
     0.9),  # 0.608 -> 0.501
    (["distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8"],
     0.5),  # 0.607 -> 0.208: the dense top-k signal
])
def test_each_variant_moves_the_student_towards_its_teacher(tmp_path, variant, factor):
    with one_thread():
        trainer = RLTrainer(tiny_config(tmp_path, LEARN + [_peaked_teacher(tmp_path)] + variant))
        history = trainer.fit()
    batch = trainer.last_batch
    assert batch["teacher_log_probs"].shape == batch["responses"].shape
    assert ("teacher_topk_ids" in batch) == ("forward_kl_topk" in variant[0])
    assert all(row["distillation/teacher_log_prob"] < 0 and "distillation/loss" in row for row in history)
    # the exact reverse KL(student || teacher) over the whole vocabulary, at the last batch's response positions:
    # the trained student's against the student it started from (the per-step metric is a one-sample estimate)
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "peaked_teacher")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path))
    before, after = _exact_kl(initial, teacher, batch), _exact_kl(trainer.workers.actor.module, teacher, batch)
    assert after < factor * before, (before, after)


def _exact_kl(student, teacher, batch) -> float:
    """Mean over valid response positions of sum_v p_s(v) (log p_s(v) - log p_t(v))."""
    import torch

    r = batch["responses"].shape[1]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        s = torch.log_softmax(student(**inputs).logits[:, -r - 1:-1].double(), -1)
        t = torch.log_softmax(teacher(**inputs).logits[:, -r - 1:-1].double(), -1)
    kl = (s.exp() * (s - t)).sum(-1)
    mask = batch["response_mask"].bool()
    return float(kl[mask].mean())


def _no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr("posttrain.workers.prepare.load_role_model", refuse)


def _routed(tmp_path, values):
    """The tiny task's training rows with a ``task`` column holding ``values`` in turn."""
    import pandas as pd

    from helpers.tiny_run import tiny_overrides

    tiny_overrides(tmp_path)
    frame = pd.read_parquet(tmp_path / "data" / "train.parquet")
    frame["task"] = [values[i % len(values)] for i in range(len(frame))]
    path = tmp_path / "data" / "routed.parquet"
    frame.to_parquet(path)
    return f"data.train_files={path}"


def _two_teachers(tmp_path, keys=("add", "sub")):
    model = tiny_model_dir(tmp_path, seed=1)
    return ["distillation.teacher_models.teacher_model.model_path=null",
            *(f"+distillation.teacher_models.t{i}.{field}" for i, key in enumerate(keys)
              for field in (f"key={key}", f"model_path={model}"))]


def _mismatched_teacher(tmp_path):
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    folder = tmp_path / "other_vocabulary"
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tiny_llama(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["missing_path", "tokenizer", "no_column", "unrouted_row", "topk"])
def test_bad_input_is_one_line_before_any_model_loads(tmp_path, monkeypatch, case):
    base = ["distillation.enabled=True"]
    if case == "missing_path":
        extra = [f"distillation.teacher_models.teacher_model.model_path={tmp_path / 'nowhere'}"]
        message = f"distillation.teacher_models.teacher_model.model_path={tmp_path / 'nowhere'}: "
    elif case == "tokenizer":
        extra = [f"distillation.teacher_models.teacher_model.model_path={_mismatched_teacher(tmp_path)}"]
        message = "its tokenizer is not the student's"
    elif case == "no_column":
        extra = _two_teachers(tmp_path) + ["distillation.teacher_key=task"]
        message = "distillation.teacher_key=task: no row of data.train_files"
    elif case == "unrouted_row":
        extra = _two_teachers(tmp_path) + ["distillation.teacher_key=task", _routed(tmp_path, ["add", "sub", "mul"])]
        message = "row 2: its task value 'mul' names no teacher (distillation.teacher_models keys: add, sub)"
    else:
        extra = [_teacher(tmp_path), "distillation.distillation_loss.topk=0"]
        message = "distillation.distillation_loss.topk=0 must be a positive number of teacher tokens"
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as err:  # (topk: refused by load_config's validation already)
        RLTrainer(tiny_config(tmp_path, base + extra))
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_several_teachers_route_by_a_data_column(tmp_path):
    """A column the prompt items do not carry by default (``task``) reaches the batch and picks each row's teacher."""
    with one_thread():
        trainer = RLTrainer(tiny_config(tmp_path, ["distillation.enabled=True", "distillation.teacher_key=task",
                                                   "trainer.total_training_steps=1",
                                                   _routed(tmp_path, ["add", "sub"])] + _two_teachers(tmp_path)))
        trainer.fit()
    assert set(trainer.last_batch.non_tensor_batch["task"]) == {"add", "sub"}
