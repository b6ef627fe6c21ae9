"""Top-k of a part, chosen the same way on every machine: the ``topk:F`` sync compression.

:func:`project` keeps the ``k = ceil(F * L)`` entries of largest magnitude of a part of ``L`` values
and zeroes the rest. Which ``k`` entries is a pure function of the values: every entry whose magnitude
is above the ``k``-th largest magnitude ``t`` (a value, so the same whichever algorithm found it), then,
among the entries whose magnitude equals ``t``, the ones with the lowest indices. ``k`` is computed
from ``F`` and ``L`` in float64 with one ``ceil``, also the same everywhere.

Projecting a projected part changes nothing: it has at most ``k`` nonzero entries, and the others are
zero whichever are kept. The reduced part of a top-k round (the sum of the contributors' top-k slices)
is sent as it is, sparse while that is smaller (:mod:`.wire`), so top-k loses nothing after the
contributors' own selection, which their error feedback accounts for.
"""

from __future__ import annotations

import math

import torch


def topk_count(fraction: float, length: int) -> int:
    """How many entries of a part of ``length`` values ``topk:fraction`` keeps (at least one of a non-empty part)."""
    return min(length, max(1, math.ceil(fraction * length))) if length else 0


def select(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (increasing, int64) of the ``k`` entries of ``x`` (L,) of largest magnitude, ties at
    the threshold going to the lowest indices."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    mag = x.abs()
    if k >= x.numel():
        return torch.arange(x.numel())
    t = torch.topk(mag, k, sorted=False).values.min()
    above = mag > t
    need = k - int(above.sum())
    (at,) = torch.where(mag == t)
    keep = above
    keep[at[:need]] = True
    (idx,) = torch.where(keep)
    return idx


def project(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """``x`` (L,) float32 with all but its top ``topk_count(fraction, L)`` entries zeroed."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("top-k cannot select among NaN or Inf")
    out = torch.zeros_like(x)
    idx = select(x, topk_count(fraction, x.numel()))
    out[idx] = x[idx]
    return out
