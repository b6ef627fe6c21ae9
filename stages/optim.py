"""The optimizer and learning-rate schedule that every replica of every stage applies identically.

AdamW, with weight decay on matrices only (norm gains are left alone), linear warmup then cosine
decay to ``min_lr``. :func:`apply_step` clips the gradient norm PER STAGE: a swarm cannot cheaply
compute a global norm across stages, so the reference trainer clips each stage separately too, which
is what lets a swarm reproduce the reference exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from protolearn.stages.config import OptimConfig


def make_optimizer(params: Iterable[nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` (in the given order); weight decay only on tensors with >= 2 dims."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr_at(0, optim),
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
        # Fixed implementation so every replica (and the reference) runs the same arithmetic.
        foreach=False,
        fused=False,
    )


def lr_at(step: int, optim: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): warmup, cosine to min_lr, then min_lr."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if step >= optim.total_steps:
        return optim.min_lr
    span = max(1, optim.total_steps - optim.warmup_steps)
    progress = (step - optim.warmup_steps) / span
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def apply_step(module: nn.Module, optimizer: torch.optim.Optimizer, step: int, optim: OptimConfig) -> float:
    """Clip this stage's grads (if ``clip_norm``), set the lr of ``step``, step, zero grads.

    Then a module with an ``after_step(step)`` method (a subspace stage) re-imposes its constraint.
    Returns this stage's gradient norm before clipping (0.0 when no parameter has a gradient).
    """
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        norm = 0.0
    elif optim.clip_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(params, optim.clip_norm, foreach=False))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
    lr = lr_at(step, optim)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after_step = getattr(module, "after_step", None)  # a stage's subspace projection (stages/stage.py)
    if after_step is not None:
        after_step(step)
    return norm
