"""AdamW construction and verl's lr schedules (constant / cosine with warm-up)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config.actor_rollout_ref import OptimConfig
from posttrain.optim.build import build_lr_scheduler, build_optimizer


def lrs(optim_cfg, steps):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], optim_cfg)
    sched = build_lr_scheduler(opt, optim_cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_adamw_from_config():
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(lr=3e-4, betas=[0.8, 0.95],
                                                                            weight_decay=0.1))
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW) and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1


def test_constant_with_warmup_steps():
    # verl: min(1, step / warmup) during warm-up, then 1
    assert lrs(OptimConfig(lr=1.0, lr_warmup_steps=3), 5) == pytest.approx([0, 1 / 3, 2 / 3, 1, 1])
    assert lrs(OptimConfig(lr=1.0), 2) == [1.0, 1.0]  # lr_warmup_steps=-1, ratio 0: no warm-up


def test_warmup_ratio_and_cosine_floor():
    cfg = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2, total_training_steps=10, lr_scheduler_type="cosine",
                      min_lr_ratio=0.1)
    got = lrs(cfg, 11)
    # 2 warm-up steps, then 0.1 + 0.9 * 0.5 * (1 + cos(pi * progress)), progress = (s - 2) / 8
    want = [0.0, 0.5] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 11)]
    assert got == pytest.approx(want)


def test_warmup_style_wins_and_errors():
    cfg = OptimConfig(lr=1.0, total_training_steps=4, lr_scheduler_type="constant", warmup_style="cosine")
    assert lrs(cfg, 3)[2] == pytest.approx(0.5)  # cosine at half-way
    with pytest.raises(ValueError, match="total_training_steps"):
        lrs(OptimConfig(lr_scheduler_type="cosine"), 1)
    with pytest.raises(ValueError, match="constant, cosine"):
        lrs(OptimConfig(lr_scheduler_type="linear"), 1)
