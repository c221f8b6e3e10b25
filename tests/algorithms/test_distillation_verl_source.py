"""Our distillation losses against verl 0.9.1's own functions, run from an unpacked wheel
(``POSTTRAIN_VERL_SRC=/path/to/unpacked/verl-0.9.1``; skipped without it, `test_distillation_loss.py` compares
with the transcription then): verl's logits processor on packed (nested) tensors, and verl's
``distillation_loss`` / ``distillation_ppo_loss`` with its own configs, on random inputs, every loss mode."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.distillation import (ESTIMATOR_LOSS_MODES, DistillationScores, combine_with_policy_loss,
                                               distillation_loss, distillation_token_losses, topk_log_probs)
from posttrain.algorithms.losses import LOSS_AGG_MODES
from tests.helpers.verl_source import verl_module

PROMPT_LENS, RESPONSE_LENS, VOCAB, K = [3, 2, 4], [5, 2, 4], 13, 4
COMPARED = {"values": 0}


@pytest.fixture(scope="module", autouse=True)
def _count():
    yield
    print(f"\ncompared with verl's own functions: {COMPARED['values']} values")


def _close(ours, theirs, name):
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    COMPARED["values"] += ours.numel()


def _packed(per_response: torch.Tensor) -> torch.Tensor:
    """``[B, R, ...]`` padded response values -> ``[total_nnz, ...]`` packed sequences, each response token's value
    at the position that predicts it (verl's ``no_padding_2_padding`` reads it back from there)."""
    rows = []
    for b, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        seq = torch.zeros((p + r, *per_response.shape[2:]), dtype=per_response.dtype)
        seq[p - 1:p - 1 + r] = per_response[b, :r]
        rows.append(seq)
    return torch.cat(rows)


def _nested(per_response: torch.Tensor):
    seqs = [s for s in torch.split(_packed(per_response), [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)])]
    return torch.nested.nested_tensor(seqs, layout=torch.jagged)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    b, r = len(PROMPT_LENS), max(RESPONSE_LENS)
    mask = torch.zeros(b, r)
    for i, n in enumerate(RESPONSE_LENS):
        mask[i, :n] = 1
    s_logits = torch.randn(b, r, VOCAB, generator=g) * 2
    t_logits = torch.randn(b, r, VOCAB, generator=g) * 2
    tokens = torch.randint(0, VOCAB, (b, r), generator=g)
    s_lp = torch.log_softmax(s_logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
    t_lp = torch.log_softmax(t_logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
    old = (s_lp + 0.3 * torch.randn(b, r, generator=g)) * mask
    t_topk_lp, t_topk_ids = torch.topk(torch.log_softmax(t_logits, -1), K, dim=-1)
    return SimpleNamespace(s_logits=s_logits, s_lp=s_lp, t_lp=t_lp, old=old, mask=mask, t_topk_lp=t_topk_lp,
                           t_topk_ids=t_topk_ids)


def _verl_configs(**loss):
    config_mod = verl_module("verl.workers.config")
    loss_cfg = config_mod.DistillationLossConfig(**loss)
    return config_mod.DistillationConfig(enabled=False, distillation_loss=loss_cfg), loss_cfg


def _data(x, agg):
    prompts = torch.nested.nested_tensor([torch.zeros(p, dtype=torch.long) for p in PROMPT_LENS], layout=torch.jagged)
    responses = torch.nested.nested_tensor([torch.zeros(r, dtype=torch.long) for r in RESPONSE_LENS],
                                           layout=torch.jagged)
    tokens = int(x.mask.sum())
    return {"prompts": prompts, "responses": responses, "response_mask": x.mask, "old_log_probs": x.old,
            "teacher_logprobs": _nested(x.t_lp[..., None]), "teacher_ids": _nested(x.t_topk_ids),
            "dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": len(PROMPT_LENS)}


def _actor_config(agg):
    return SimpleNamespace(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None)


@pytest.mark.parametrize("min_clamp", [None, -1.5])
def test_logits_processor_equals_verls(min_clamp):
    fsdp_losses = verl_module("verl.trainer.distillation.fsdp.losses")
    x = _inputs(1)
    distill_cfg, _ = _verl_configs(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=min_clamp,
                                   use_policy_gradient=False)
    out = fsdp_losses.compute_forward_kl_topk(_packed(x.s_logits)[None], _nested(x.t_topk_lp), _nested(x.t_topk_ids),
                                              distill_cfg, "thd")
    s_topk = topk_log_probs(x.s_logits, x.t_topk_ids)
    student_ids = torch.topk(x.s_logits, K, dim=-1).indices
    scores = DistillationScores(x.s_lp, x.t_lp, x.mask, s_topk, x.t_topk_lp, x.t_topk_ids, student_ids)
    losses, metrics = distillation_token_losses("forward_kl_topk", scores, min_clamp)
    valid, at = x.mask.bool(), _packed(x.mask[..., None]).squeeze(-1).bool()  # the response tokens, packed
    _close(losses[valid], out["distillation_losses"][0][at].clamp_min(0.0), "losses")
    _close(metrics["distillation/student_mass"], out["student_mass"][0][at].mean(), "student_mass")
    _close(metrics["distillation/teacher_mass"], out["teacher_mass"][0][at].mean(), "teacher_mass")
    count = out["overlap_count"][0][at]
    _close(metrics["distillation/overlap_ratio"], count.float().mean() / K, "overlap_ratio")


@pytest.mark.parametrize("loss_mode", ESTIMATOR_LOSS_MODES)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("pg", [False, True])
def test_distillation_loss_equals_verls(loss_mode, agg, pg):
    if loss_mode in ("kl", "k1") and not pg:
        pytest.skip("verl refuses k1 as a supervised loss")
    losses_mod = verl_module("verl.trainer.distillation.losses")
    x = _inputs(2 + LOSS_AGG_MODES.index(agg))
    distill_cfg, loss_cfg = _verl_configs(loss_mode=loss_mode, use_policy_gradient=pg, loss_max_clamp=0.8,
                                          clip_ratio_high=0.28)
    s_theirs = _packed(x.s_lp[..., None]).squeeze(-1).clone().requires_grad_(True)
    info_keys = {"dp_size": 1, "batch_num_tokens": int(x.mask.sum()), "global_batch_size": len(PROMPT_LENS)}
    theirs, their_metrics = losses_mod.distillation_loss(_actor_config(agg), distill_cfg, {"log_probs": s_theirs},
                                                         _data(x, agg))
    s_ours = x.s_lp.clone().requires_grad_(True)
    losses, metrics = distillation_token_losses(loss_mode, DistillationScores(s_ours, x.t_lp, x.mask))
    ours, loss_metrics = distillation_loss(losses, x.mask, agg, loss_max_clamp=0.8, use_policy_gradient=pg,
                                           log_prob=s_ours, old_log_prob=x.old, policy_config=loss_cfg,
                                           global_batch_info=dict(info_keys, loss_scale_factor=None))
    _close(ours, theirs, "loss")
    (g_ours,), (g_theirs,) = torch.autograd.grad(ours, s_ours), torch.autograd.grad(theirs, s_theirs)
    _close(_packed(g_ours[..., None]).squeeze(-1), g_theirs, "gradient")
    mine = {**metrics, **loss_metrics}
    for name, value in their_metrics.items():
        value = value.aggregate() if hasattr(value, "aggregate") else value  # verl's Metric wrapper
        _close(mine[name], value, name)


@pytest.mark.parametrize("use_task_rewards", [False, True])
@pytest.mark.parametrize("pg", [False, True])
def test_distillation_ppo_loss_combination_equals_verls(use_task_rewards, pg, monkeypatch):
    losses_mod = verl_module("verl.trainer.distillation.losses")
    distill_cfg, _ = _verl_configs(loss_mode="k3", use_policy_gradient=pg, use_task_rewards=use_task_rewards,
                                   distillation_loss_coef=0.3)
    monkeypatch.setattr(losses_mod, "distillation_loss", lambda *a: (torch.tensor(0.7), {}))
    monkeypatch.setattr(losses_mod, "ppo_loss", lambda *a: (torch.tensor(-1.2), {}))
    theirs, _ = losses_mod.distillation_ppo_loss(_actor_config("token-mean"), distill_cfg, {}, {})
    ours = combine_with_policy_loss(torch.tensor(0.7), torch.tensor(-1.2), use_task_rewards=use_task_rewards,
                                    distillation_loss_coef=0.3)
    _close(ours, theirs, "combined loss")
