"""Robust aggregation of one collective part: trimmed mean and CenteredClip instead of the plain mean.

A reducer of a collective part holds one slice per contributor and must produce bytes that any other
reducer of the same contributor set ``S`` produces too (:mod:`.ownership`). So every rule here is a
**pure deterministic function of S and the slices**: contributors in sorted order, a stable sort (whose
output is unique), elementwise IEEE operations only (each correctly rounded, so SIMD width and thread
count cannot change a bit), norms summed in a fixed pairwise tree, fixed iteration counts, float64
inside and one rounding to float32 at the end.

What a replica contributes is the *sum* of the gradients of the tickets it processed (``op="sum"``,
weight = its ticket count), or already a mean (``op="weighted_mean"``). The rules act on per-replica
per-ticket means ``m_i = x_i / w_i`` (``x_i`` itself for ``weighted_mean``), and scale the robust centre
back by ``W = sum of w_i`` for ``sum``, so the result has the scale the plain sum or mean would have.

* ``trimmed_mean``: per coordinate, drop the ``b`` smallest and ``b`` largest of the ``k`` means
  (``b = floor(trim_fraction * k)``, at least 1 once ``k >= 3`` and ``trim_fraction > 0``) and take the
  ticket-weighted mean of the rest. With 3 replicas this is the coordinate-wise median. **Bound**: with
  at most ``b`` arbitrary outliers, every coordinate of the result lies within the honest replicas'
  range of that coordinate (each kept value does).
* ``centered_clip`` (Karimireddy et al. 2021; BTARD applies it per part, as here): start from the
  coordinate-wise median ``v0``, fix ``tau = clip_tau * median_i ||m_i - v0||`` (scale-free), then
  ``clip_iters`` times ``v <- v + sum_i w_i clip(m_i - v, tau) / W`` with ``clip(d, tau) = d * min(1,
  tau / ||d||)``. **Bound**: each step moves ``v`` by at most ``tau``, so ``||v - v0|| <= clip_iters *
  tau``; with one outlier among ``k >= 3``, ``v0`` lies in the honest box (coordinate-wise range) and
  ``tau <= clip_tau * D`` with ``D`` the largest honest distance to ``v0``, so the result is within
  ``clip_iters * clip_tau * D`` of the honest box, however large the outlier.

With fewer than 3 contributors no rule can tell an outlier from an honest replica, so both robust rules
return exactly the plain reduction (:func:`~.ownership.reduce_part`) there, as ``mean`` always does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from protolearn.protocol.collective.ownership import Op, reduce_part

Rule = Literal["mean", "trimmed_mean", "centered_clip"]
RULES: tuple[str, ...] = ("mean", "trimmed_mean", "centered_clip")
MAX_CLIP_ITERS = 100
# Below this many contributors the robust rules are the mean (see the module docstring).
MIN_ROBUST = 3

__all__ = ["MAX_CLIP_ITERS", "RULES", "Aggregation", "centered_clip", "coordinate_median", "robust_reduce", "trim_count",
           "trimmed_mean"]


@dataclass(frozen=True)
class Aggregation:
    """How a collective part combines its contributors: ``rule`` and that rule's parameters."""

    rule: Rule = "mean"
    trim_fraction: float = 0.25
    clip_tau: float = 1.0
    clip_iters: int = 3

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregation rule must be one of {RULES}, got {self.rule!r}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if not (0.0 < self.clip_tau <= 1e6):
            raise ValueError(f"clip_tau must be in (0, 1e6], got {self.clip_tau}")
        if not 1 <= self.clip_iters <= MAX_CLIP_ITERS:
            raise ValueError(f"clip_iters must be in 1..{MAX_CLIP_ITERS}, got {self.clip_iters}")

    @classmethod
    def from_config(cls, cfg: Any) -> Aggregation:
        """From a run config's ``[integrity]`` section (``stages.config.IntegrityConfig``: duck-typed, so that
        this module stays free of the stages package)."""
        return cls(cfg.aggregation, float(cfg.trim_fraction), float(cfg.clip_tau), int(cfg.clip_iters))

    @property
    def tag(self) -> str:
        """The rule with the parameters it uses, as bound into a round's statements ("mean" stays "mean")."""
        if self.rule == "trimmed_mean":
            return f"trimmed_mean:{self.trim_fraction!r}"
        if self.rule == "centered_clip":
            return f"centered_clip:{self.clip_tau!r}:{self.clip_iters}"
        return "mean"


def trim_count(k: int, fraction: float) -> int:
    """How many of ``k`` values trimmed_mean drops at each end (always leaves at least one)."""
    if k < MIN_ROBUST or fraction <= 0.0:
        return 0
    return max(1, min(int(math.floor(fraction * k)), (k - 1) // 2))


def _tree_sum(x: torch.Tensor) -> float:
    """Sum of a float64 vector in a fixed pairwise order (elementwise adds only: the same bits anywhere)."""
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[0::2] + x[1::2]
    return float(x[0]) if x.numel() else 0.0


def _norm(d: torch.Tensor) -> float:
    return math.sqrt(_tree_sum(d * d))


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    k = len(s)
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) * 0.5


def coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``rows`` (k, L) float64; the mean of the two middle values for even k."""
    vals = torch.sort(rows, dim=0, stable=True).values  # (k, L)
    k = rows.shape[0]
    return vals[k // 2].clone() if k % 2 else (vals[k // 2 - 1] + vals[k // 2]) * 0.5


def trimmed_mean(rows: torch.Tensor, weights: Sequence[float], fraction: float) -> torch.Tensor:
    """Per coordinate, the ``weights``-weighted mean of ``rows`` (k, L) float64 without the
    :func:`trim_count` smallest and largest values."""
    k = rows.shape[0]
    b = trim_count(k, fraction)
    vals, idx = torch.sort(rows, dim=0, stable=True)  # (k, L) each
    wt = torch.tensor(list(weights), dtype=torch.float64)[idx]  # (k, L): each value's weight
    num = torch.zeros_like(rows[0])
    den = torch.zeros_like(rows[0])
    for r in range(b, k - b):  # fixed order, separate multiply and add
        num += vals[r] * wt[r]
        den += wt[r]
    return num / den


def centered_clip(rows: torch.Tensor, weights: Sequence[float], tau: float, iters: int) -> torch.Tensor:
    """CenteredClip of ``rows`` (k, L) float64 from the coordinate-wise median, radius ``tau`` times the
    median distance to it, ``iters`` fixed iterations (see the module docstring)."""
    v = coordinate_median(rows)  # (L,)
    radius = tau * _median([_norm(rows[i] - v) for i in range(rows.shape[0])])
    total = math.fsum(weights)
    for _ in range(iters):
        step = torch.zeros_like(v)
        for i, w in enumerate(weights):
            d = rows[i] - v
            n = _norm(d)
            step += d * (w * min(1.0, radius / n) if n > 0 else w)
        v = v + step / total
    return v


def robust_reduce(
    slices: Mapping[str, torch.Tensor], members: Collection[str], weights: Mapping[str, float], op: Op, length: int,
    agg: Aggregation,
) -> torch.Tensor:
    """The part over ``members`` under ``agg`` from their float32 ``slices``: float32 of ``length``, the same
    bytes for the same inputs on any machine. ``mean`` (and fewer than 3 members) is :func:`reduce_part`."""
    order = sorted(members)
    if agg.rule == "mean" or len(order) < MIN_ROBUST or (agg.rule == "trimmed_mean" and trim_count(len(order), agg.trim_fraction) == 0):
        return reduce_part(slices, order, weights, op, length)
    ws = [float(weights[p]) for p in order]
    # Per-ticket means; "+ 0.0" turns -0.0 into +0.0 so that ties never differ in a sign bit.
    rows = torch.stack([(slices[p].double() / w if op == "sum" else slices[p].double()) + 0.0 for p, w in zip(order, ws)])  # (k, L)
    if agg.rule == "trimmed_mean":
        centre = trimmed_mean(rows, ws, agg.trim_fraction)
    else:
        centre = centered_clip(rows, ws, agg.clip_tau, agg.clip_iters)
    if op == "sum":
        centre = centre * math.fsum(ws)
    return centre.to(torch.float32)
