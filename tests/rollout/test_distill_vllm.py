"""On-policy distillation with the vllm rollout engine (marker ``vllm``; runs where vLLM is importable): the
student samples with vLLM, the teacher (a frozen model in the trainer's process, whatever the engine) scores
those tokens, and its scores equal the teacher's own full-logits forward on the same batch."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_run import tiny_config
from helpers.tokenizer import build_tiny_tokenizer
# this folder is on sys.path (no __init__)
from test_rollout_vllm import fit_then_shut_down, vllm_llama, vllm_only, vllm_run_overrides


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@vllm_only
@pytest.mark.parametrize("loss", [["distillation.distillation_loss.loss_mode=forward_kl_topk",
                                   "distillation.distillation_loss.topk=4"],
                                  ["distillation.distillation_loss.loss_mode=k1",
                                   "distillation.distillation_loss.use_policy_gradient=True"]])
def test_opd_trains_with_vllm_samples(tmp_path, tok, loss):
    from posttrain.trainer.trainer import RLTrainer

    teacher = tmp_path / "teacher"
    vllm_llama(tok, seed=3).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    overrides = vllm_run_overrides(tok, tmp_path / "model", seed=7) + [
        "distillation.enabled=True", f"distillation.teacher_models.teacher_model.model_path={teacher}", *loss]
    trainer = RLTrainer(tiny_config(tmp_path, overrides), tokenizer=tok)
    history = fit_then_shut_down(trainer)
    assert [r["step"] for r in history] == [1, 2]
    assert all("distillation/loss" in r and "timing_s/teacher" in r for r in history)
    batch = trainer.last_batch
    r = batch["responses"].shape[1]
    model = vllm_llama(tok, seed=3).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -r - 1:-1]
    want = torch.log_softmax(logits.double(), -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["teacher_log_probs"][mask].double(), want[mask], atol=1e-4, rtol=0)
