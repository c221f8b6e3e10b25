"""The teacher role of on-policy distillation: its scores equal a plain full-logits forward of the teacher (the
independent reference), the student's top-k forward equals one too (values and gradients), several teachers
each score their own rows (spies), and the `Distill` objective is the sum verl's distillation_ppo_loss makes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.algorithms.distillation import DistillationScores, distillation_loss, distillation_token_losses
from posttrain.algorithms.objectives import PPO, Distill
from posttrain.models import topk_logprobs as topk_mod
from posttrain.models.topk_logprobs import compute_response_topk, response_topk_logprobs
from posttrain.workers.common import MetricMeter
from posttrain.workers.teacher import Teachers, TeacherWorker, route_rows


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _batch(tok, texts=("1+1=", "hello 2*3=", "9-4=", "x"), resp_len=6, seed=0):
    """Prompts with sampled-looking responses: random tokens, the second row's response ending early."""
    prompts = tiny_prompt_batch(tok, list(texts))
    g = torch.Generator().manual_seed(seed)
    n = len(prompts)
    responses = torch.randint(6, len(tok), (n, resp_len), generator=g)
    resp_mask = torch.ones(n, resp_len, dtype=torch.long)
    resp_mask[1, 3:] = 0
    responses[1, 3:] = tok.pad_token_id
    ids = torch.cat([prompts["input_ids"], responses], 1)
    mask = torch.cat([prompts["attention_mask"], resp_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": responses,
            "response_mask": resp_mask.float()}


def _reference(model, b, temperature=1.0):
    """log_softmax of the model's full logits at the response positions: ``[N, R, V]``, float64."""
    r = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    return torch.log_softmax(logits[:, -r - 1:-1].double() / temperature, -1)


@pytest.mark.parametrize("layout", ["plain", "remove_padding", "shared_prefix"])
def test_teacher_topk_equals_a_full_logits_forward(tok, layout):
    model = tiny_llama(tok, seed=3).eval()
    b = _batch(tok)
    mask = b["response_mask"].bool()
    with torch.no_grad():
        want = _reference(model, b)
        got = compute_response_topk(model, b, k=5, micro_batch_size=3, remove_padding=layout == "remove_padding",
                                    shared_prefix=layout == "shared_prefix")
    sampled = want.gather(-1, b["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(got.log_probs[mask].double(), sampled[mask], atol=2e-5, rtol=0)
    top_values, top_ids = torch.topk(want, 5, dim=-1)
    torch.testing.assert_close(got.topk_log_probs[mask].double(), top_values[mask], atol=2e-5, rtol=0)
    assert torch.equal(got.topk_ids[mask], top_ids[mask])
    assert (got.log_probs[~mask] == 0).all() and (got.topk_ids[~mask] == 0).all()  # padding positions hold 0


@pytest.mark.parametrize("path", ["lean head", "autograd chunks"])
def test_student_log_probs_at_the_teachers_tokens_equal_a_full_forward_with_gradients(tok, path, monkeypatch):
    student = tiny_llama(tok, seed=1)
    if path == "autograd chunks":  # a head with a hook is not a plain linear one: chunks of 4 rows, recomputed
        monkeypatch.setattr(topk_mod, "TRAIN_CHUNK_ELEMENTS", 4 * len(tok))
        student.lm_head.register_forward_hook(lambda module, args, out: out)
    else:  # record whether the chunked path ran with gradients
        calls, real = [], topk_mod._chunked
        monkeypatch.setattr(topk_mod, "_chunked", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    b = _batch(tok, seed=1)
    mask = b["response_mask"].bool()
    ids = torch.randint(0, len(tok), (*b["responses"].shape, 4), generator=torch.Generator().manual_seed(2))
    out = response_topk_logprobs(student, b["input_ids"], b["attention_mask"], b["position_ids"], b["responses"],
                                 ids=ids, k=4, temperature=0.7, calculate_entropy=True)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5))
    loss = (out.at_ids * weights).sum() + out.log_probs.sum() + out.entropy.sum()
    grads = torch.autograd.grad(loss, list(student.parameters()))

    ref_logp = _reference(student, b, temperature=0.7)
    ref_at = ref_logp.gather(-1, ids) * mask[..., None]
    ref_lp = ref_logp.gather(-1, b["responses"][..., None]).squeeze(-1) * mask
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1) * mask
    torch.testing.assert_close(out.at_ids.double(), ref_at, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_ent, atol=2e-5, rtol=0)
    assert torch.equal(out.topk_ids[mask], torch.topk(ref_logp, 4, -1).indices[mask])
    if path == "lean head":  # the chunked log-softmax path never ran
        assert calls == []
    ref_loss = (ref_at * weights).sum() + ref_lp.sum() + ref_ent.sum()
    ref_grads = torch.autograd.grad(ref_loss, list(student.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)


def test_inside_the_update_the_heads_gradient_goes_into_grad_with_the_same_values(tok):
    """In the update's micro-step (`grads_into_params`, loss.backward()) the head rows' gradient is added into
    ``.grad`` row by row (no dense vocabulary-sized tensor): the same gradients as plain autograd."""
    from posttrain.models.lean.into_grad import embeddings_add_into_grad, grads_into_params

    b = _batch(tok, seed=2)
    ids = torch.randint(0, len(tok), (*b["responses"].shape, 4), generator=torch.Generator().manual_seed(3))
    grads = []
    for into_grad in (False, True):
        student = tiny_llama(tok, seed=1)
        if into_grad:
            embeddings_add_into_grad(student)
        with grads_into_params() if into_grad else torch.enable_grad():
            out = response_topk_logprobs(student, b["input_ids"], b["attention_mask"], b["position_ids"],
                                         b["responses"], ids=ids, k=4)
            (out.at_ids.sum() + out.log_probs.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-5, rtol=1e-5, msg=name)


def test_a_teacher_worker_scores_like_its_model(tok):
    cfg = tiny_worker_configs(micro_batch_size=2)
    model = tiny_llama(tok, seed=4)
    b = _batch(tok)
    mask = b["response_mask"].bool()
    with torch.no_grad():
        want = _reference(model, b).gather(-1, b["responses"][..., None]).squeeze(-1)
    lp, ids, lps = TeacherWorker(model, cfg.ref, topk=None).score(b)
    assert ids is None and lps is None
    torch.testing.assert_close(lp[mask].double(), want[mask], atol=2e-5, rtol=0)
    lp_k, ids_k, lps_k = TeacherWorker(model, cfg.ref, topk=3).score(b)
    torch.testing.assert_close(lp_k[mask], lp[mask], atol=1e-5, rtol=0)
    assert ids_k.shape == (4, 6, 3) and lps_k.shape == (4, 6, 3)
    assert not any(p.requires_grad for p in model.parameters())  # frozen


class _ConstantTeacher:
    """A spy: scores every token it is given with its own constant and records the rows it saw."""

    def __init__(self, value: float, topk: int | None = None):
        self.value, self.topk, self.module, self.seen = value, topk, None, []

    def score(self, part):
        self.seen.append(part["input_ids"].clone())
        n, r = part["responses"].shape
        ids = torch.full((n, r, self.topk), int(self.value), dtype=torch.long) if self.topk else None
        return torch.full((n, r), self.value), ids, (torch.full((n, r, self.topk), self.value) if self.topk else None)


def _with_sources(tok, sources):
    from posttrain.batch import Batch

    b = _batch(tok)
    return Batch.from_dict({k: v for k, v in b.items()}, {"data_source": np.array(sources, dtype=object)})


def test_each_row_is_scored_by_the_teacher_its_key_names(tok):
    arith, maths = _ConstantTeacher(-1.0, topk=2), _ConstantTeacher(-7.0, topk=2)
    teachers = Teachers({"arithmetic": arith, "math": maths}, "data_source")
    batch = _with_sources(tok, ["arithmetic", "math", "math", "arithmetic"])
    lp, ids, lps = teachers.compute_teacher_log_prob(batch)
    assert lp[:, 0].tolist() == [-1.0, -7.0, -7.0, -1.0]
    assert ids[:, 0, 0].tolist() == [-1, -7, -7, -1] and lps[:, 0, 1].tolist() == [-1.0, -7.0, -7.0, -1.0]
    # each spy saw exactly its rows
    assert torch.equal(arith.seen[0], batch["input_ids"][[0, 3]]) and torch.equal(maths.seen[0], batch["input_ids"][[1, 2]])
    # negative control: swapping the keys swaps the scores
    swapped = Teachers({"arithmetic": maths, "math": arith}, "data_source")
    assert swapped.compute_teacher_log_prob(batch)[0][:, 0].tolist() == [-7.0, -1.0, -1.0, -7.0]


def test_two_real_teachers_each_score_their_rows_like_their_own_forward(tok):
    cfg = tiny_worker_configs(micro_batch_size=2)
    a, m = tiny_llama(tok, seed=5), tiny_llama(tok, seed=6)
    teachers = Teachers({"arithmetic": TeacherWorker(a, cfg.ref, topk=None),
                         "math": TeacherWorker(m, cfg.ref, topk=None)}, "data_source")
    batch = _with_sources(tok, ["math", "arithmetic", "arithmetic", "math"])
    lp, _, _ = teachers.compute_teacher_log_prob(batch)
    plain = {k: v for k, v in batch.batch.items()}
    with torch.no_grad():
        by_a = _reference(a, plain).gather(-1, plain["responses"][..., None]).squeeze(-1).float()
        by_m = _reference(m, plain).gather(-1, plain["responses"][..., None]).squeeze(-1).float()
    mask = plain["response_mask"].bool()
    for row, model_scores in ((0, by_m), (1, by_a), (2, by_a), (3, by_m)):
        torch.testing.assert_close(lp[row][mask[row]], model_scores[row][mask[row]], atol=2e-5, rtol=0)
    assert not torch.allclose(lp[0][mask[0]], by_a[0][mask[0]], atol=1e-3)  # the other teacher differs


def test_a_row_naming_no_teacher_is_one_line():
    with pytest.raises(ValueError, match=r"row 2: its distillation.teacher_key value 'gsm8k' names no teacher "
                                         r"\(teachers: arithmetic, math\)"):
        route_rows(np.array(["math", "arithmetic", "gsm8k"], dtype=object), ["arithmetic", "math"])
    assert route_rows(np.array(["x", "y"], dtype=object), ["default"])["default"].tolist() == [0, 1]  # one: all rows


@pytest.mark.parametrize("use_task_rewards, pg", [(True, False), (False, False), (True, True), (False, True)])
def test_the_objective_is_verls_sum_of_the_two_losses(use_task_rewards, pg):
    g = torch.Generator().manual_seed(0)
    cfg = tiny_worker_configs().actor
    n, r = 4, 5
    log_prob = (torch.randn(n, r, generator=g) - 2).requires_grad_(True)
    mb = {"teacher_log_probs": torch.randn(n, r, generator=g) - 2, "advantages": torch.randn(n, r, generator=g),
          "old_log_probs": log_prob.detach() + 0.1 * torch.randn(n, r, generator=g),
          "response_mask": torch.ones(n, r)}
    info = {"dp_size": 1, "batch_num_tokens": float(n * r), "global_batch_size": float(n)}
    mode = "k1" if pg else "k3"
    objective = Distill(loss_mode=mode, use_task_rewards=use_task_rewards, distillation_loss_coef=0.3,
                        use_policy_gradient=pg, loss_max_clamp=2.0)
    meter = MetricMeter()
    entropy = torch.rand(n, r, generator=g)
    total = objective.loss(log_prob, entropy, mb, info, meter, cfg)
    losses, _ = distillation_token_losses(mode, DistillationScores(log_prob, mb["teacher_log_probs"], mb["response_mask"]))
    distill, _ = distillation_loss(losses, mb["response_mask"], cfg.loss_agg_mode, loss_max_clamp=2.0,
                                   use_policy_gradient=pg, log_prob=log_prob, old_log_prob=mb["old_log_probs"],
                                   policy_config=objective, global_batch_info=info)
    ppo = PPO().loss(log_prob, entropy, mb, info, MetricMeter(), cfg)
    want = ppo + 0.3 * distill if use_task_rewards else distill
    torch.testing.assert_close(total, want)
    meter.end_mini_batch()
    metrics = meter.result()
    assert metrics["distillation/loss"] == pytest.approx(float(distill), rel=1e-6)
    kl = (log_prob - mb["teacher_log_probs"]).mean()
    assert metrics["distillation/reverse_kl"] == pytest.approx(float(kl), rel=1e-5)
    assert ("actor/pg_loss" in metrics) == (use_task_rewards or pg)
