"""DiLoCo's outer optimizer: the pseudo-gradient and the Nesterov outer step, on flat float32 vectors.

Between two outer syncs each replica of a stage takes its own AdamW inner steps (``stages/optim.py``).
At sync k+1 the replicas hold the same anchor ``theta_k`` (the parameters after sync k) and the same
momentum ``m_k``, and each has its own ``theta``. Each contributes its **pseudo-gradient**
``delta = theta_k - theta`` (:func:`pseudo_gradient`; a flat vector over the stage's parameters in
sorted name order, the order the collective uses for gradients), the collective averages them weighted by
tokens (``avg``), and every participant applies the same **Nesterov step** (:func:`nesterov_step`),
SGD-with-Nesterov-momentum on the pseudo-gradient as in DiLoCo (Douillard et al. 2023, their outer lr 0.7
and momentum 0.9)::

    m_{k+1}     = mu * m_k + avg
    theta_{k+1} = theta_k - lr * (avg + mu * m_{k+1})

Why every participant ends bit-identical (I2 in DiLoCo mode: "replicas are identical after every outer
sync"): ``theta_k`` and ``m_k`` are identical on entry (they are the previous sync's output, or what a
joiner took from a participant and checked against the stage's majority hash), ``avg`` is the
collective's result, identical on every survivor bit for bit, and the step is a fixed sequence of
elementwise float32 operations on the CPU (each correctly rounded, so no thread count or SIMD width
changes a bit). Pure: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat float32 CPU vector of ``tensors`` in order: ``(sum of numel,)``."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def pseudo_gradient(anchor: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``anchor - theta``: what the replica's inner steps moved since the last sync, flat float32 ``(N,)``."""
    now = flatten(params)
    if now.shape != anchor.shape:
        raise ValueError(f"the anchor holds {anchor.numel()} numbers but the parameters {now.numel()}")
    return anchor - now


def nesterov_step(anchor: torch.Tensor, momentum: torch.Tensor, avg: torch.Tensor, *, lr: float, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The outer step: returns the new (anchor, momentum), both new flat float32 ``(N,)`` tensors."""
    if not anchor.shape == momentum.shape == avg.shape:
        raise ValueError(f"outer step over mismatched vectors: anchor {list(anchor.shape)}, momentum "
                         f"{list(momentum.shape)}, average {list(avg.shape)}")
    m = momentum * mu + avg
    theta = anchor - (avg + m * mu) * lr
    return theta, m


def unflatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` ``(N,)`` into ``params`` in order (each keeps its device and dtype)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p).to(p.device, p.dtype))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"a vector of {flat.numel()} numbers for parameters of {offset}")
