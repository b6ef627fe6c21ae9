"""Robust aggregation of a collective part: the mean when replicas agree, bounded by honest replicas when
one is an arbitrary outlier, and the same bytes on every call (any reducer must get them)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.protocol.collective.ownership import reduce_part
from protolearn.protocol.collective.robust import Aggregation, coordinate_median, robust_reduce, trim_count

TRIMMED = Aggregation("trimmed_mean", trim_fraction=0.25)
CLIP = Aggregation("centered_clip", clip_tau=1.0, clip_iters=3)


def honest_means(k: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, generator=gen) + 0.1 * torch.randn(k, length, generator=gen)  # (k, L)


def as_slices(means: torch.Tensor, weights: dict[str, float], op: str) -> dict[str, torch.Tensor]:
    """What each replica sends: the sum of its tickets (mean x count) for op=sum, the mean itself otherwise."""
    return {p: (means[i] * (w if op == "sum" else 1.0)).float() for i, (p, w) in enumerate(sorted(weights.items()))}


def test_trim_count_keeps_at_least_one_and_trims_one_from_three() -> None:
    assert [trim_count(k, 0.25) for k in (1, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 1, 1, 2, 2]
    assert trim_count(3, 0.49) == 1 and trim_count(9, 0.0) == 0
    with pytest.raises(ValueError, match="trim_fraction"):
        Aggregation("trimmed_mean", trim_fraction=0.5)
    with pytest.raises(ValueError, match="rule"):
        Aggregation("median")  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", [TRIMMED, CLIP], ids=["trimmed", "clip"])
@pytest.mark.parametrize("op", ["sum", "weighted_mean"])
def test_equals_the_mean_when_all_replicas_agree(agg: Aggregation, op: str) -> None:
    gen = torch.Generator().manual_seed(1)
    common = torch.randn(41, generator=gen)
    weights = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 5.0, "e": 1.0}
    slices = {p: (common * (w if op == "sum" else 1.0)).float() for p, w in weights.items()}
    got = robust_reduce(slices, weights, weights, op, 41, agg)
    torch.testing.assert_close(got, reduce_part(slices, weights, weights, op, 41), rtol=1e-6, atol=1e-6)


def test_three_replicas_trimmed_mean_is_the_coordinate_median() -> None:
    means = honest_means(3, 17, 2)
    weights = {"a": 2.0, "b": 1.0, "c": 4.0}
    got = robust_reduce(as_slices(means, weights, "weighted_mean"), weights, weights, "weighted_mean", 17, TRIMMED)
    assert torch.equal(got, coordinate_median(means.double()).float())


def test_fewer_than_three_replicas_get_exactly_the_plain_reduction() -> None:
    means = honest_means(2, 9, 3) * 1e3
    weights = {"a": 2.0, "b": 1.0}
    slices = as_slices(means, weights, "sum")
    for agg in (TRIMMED, CLIP):
        assert torch.equal(robust_reduce(slices, weights, weights, "sum", 9, agg), reduce_part(slices, weights, weights, "sum", 9))


@settings(max_examples=60, deadline=None)
@given(k=st.sampled_from([3, 5]), seed=st.integers(0, 10_000), scale=st.sampled_from([1e3, 1e12, 1e30, -1e30]),
       op=st.sampled_from(["sum", "weighted_mean"]))
def test_one_arbitrary_outlier_stays_within_the_stated_bound(k: int, seed: int, scale: float, op: str) -> None:
    rng = random.Random(seed)
    length = rng.randint(1, 40)
    means = honest_means(k, length, seed).double()
    bad = rng.randrange(k)
    gen = torch.Generator().manual_seed(seed + 1)
    means[bad] = torch.randn(length, generator=gen, dtype=torch.float64) * scale
    weights = {f"p{i}": float(rng.randint(1, 4)) for i in range(k)}
    total = sum(weights.values())
    slices = as_slices(means, weights, op)
    rows = torch.stack([slices[p].double() / (w if op == "sum" else 1.0) for p, w in sorted(weights.items())])  # (k, L)
    honest = torch.cat([rows[:bad], rows[bad + 1:]])  # (k-1, L)
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    unscale = total if op == "sum" else 1.0
    tol = 1e-5 * (1.0 + honest.abs().max())

    got = robust_reduce(slices, weights, weights, op, length, TRIMMED).double() / unscale
    assert bool(((got >= lo - tol) & (got <= hi + tol)).all()), "trimmed mean: every coordinate within the honest range"

    got = robust_reduce(slices, weights, weights, op, length, CLIP).double() / unscale
    v0 = coordinate_median(rows)
    assert bool(((v0 >= lo) & (v0 <= hi)).all())
    reach = max(float((h - v0).norm()) for h in honest)  # D: the largest honest distance to the start
    outside = (got - got.clamp(lo, hi)).norm()  # distance from the honest box
    assert float(outside) <= CLIP.clip_iters * CLIP.clip_tau * reach * (1 + 1e-6) + float(tol)


@pytest.mark.parametrize("agg", [TRIMMED, CLIP], ids=["trimmed", "clip"])
def test_same_bytes_across_calls_and_member_orders(agg: Aggregation) -> None:
    means = honest_means(5, 1001, 4).double() * torch.logspace(-3, 3, 1001, dtype=torch.float64)
    means[2, :10] = -0.0  # signed zeros tie with +0.0 elsewhere: the sign bit must not depend on the sort
    means[3, :10] = 0.0
    weights = {f"p{i}": float(i + 1) for i in range(5)}
    slices = as_slices(means, weights, "sum")
    first = robust_reduce(slices, weights, weights, "sum", 1001, agg)
    again = robust_reduce(dict(reversed(list(slices.items()))), list(reversed(sorted(weights))), weights, "sum", 1001, agg)
    assert first.dtype == torch.float32 and first.numpy().tobytes() == again.numpy().tobytes()
    assert Aggregation().tag == "mean" and agg.tag != "mean"
