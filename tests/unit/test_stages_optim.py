"""The learning-rate schedule and the per-stage optimizer step."""

from __future__ import annotations

import math

import pytest
import torch

from protolearn.stages.config import OptimConfig, RunConfig
from protolearn.stages.optim import apply_step, lr_at, make_optimizer
from protolearn.stages.stage import build_stage


def test_schedule_warms_up_then_decays_to_min_lr() -> None:
    o = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=10, total_steps=110)
    assert lr_at(0, o) == pytest.approx(1e-3)
    assert lr_at(9, o) == pytest.approx(1e-2)
    assert lr_at(10, o) == pytest.approx(1e-2)
    assert lr_at(60, o) == pytest.approx(1e-3 + 0.5 * 9e-3)
    assert lr_at(110, o) == lr_at(1000, o) == pytest.approx(1e-3)
    lrs = [lr_at(s, o) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay after warmup
    assert lr_at(0, OptimConfig(warmup_steps=0, total_steps=5)) == pytest.approx(OptimConfig().lr)


def _stage_with_grads(clip: float | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, OptimConfig]:
    run = RunConfig.model_validate(
        {"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 24, "max_seq_len": 8},
         "batch": {"seq_len": 8}, "optim": {"clip_norm": clip}}
    )
    st = build_stage(run, 0)
    for p in st.parameters():
        p.grad = torch.full_like(p, 3.0)
    return st, make_optimizer(st.parameters(), run.optim), run.optim


def test_apply_step_clips_this_stage_sets_lr_and_zeroes_grads() -> None:
    st, opt, o = _stage_with_grads(clip=0.5)
    n = sum(p.numel() for p in st.parameters())
    norm = apply_step(st, opt, 0, o)
    assert norm == pytest.approx(3.0 * math.sqrt(n), rel=1e-5)  # the pre-clip norm is reported
    assert all(p.grad is None for p in st.parameters())
    assert all(g["lr"] == pytest.approx(lr_at(0, o)) for g in opt.param_groups)

    # Clipping scales every grad by clip/norm, so AdamW's first step is the same either way
    # (Adam is scale invariant) but the stored moments show the clipped gradient.
    st2, opt2, o2 = _stage_with_grads(clip=0.5)
    apply_step(st2, opt2, 0, o2)
    p0 = next(iter(st2.parameters()))
    exp_avg = opt2.state[p0]["exp_avg"]
    assert torch.allclose(exp_avg, torch.full_like(p0, (1 - o2.betas[0]) * 3.0 * 0.5 / (3.0 * math.sqrt(n))))


def test_no_weight_decay_on_norm_gains() -> None:
    st, opt, _ = _stage_with_grads(clip=None)
    by_decay = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert all(p.dim() >= 2 for p in by_decay[0.1]) and all(p.dim() == 1 for p in by_decay[0.0])
