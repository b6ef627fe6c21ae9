"""The tensor adversaries: each lie does what its name says, is deterministic, and leaves its input alone."""

from __future__ import annotations

import pytest
import torch

from protolearn.errors import ConfigError
from protolearn.node.adversary import KINDS, NAN_FRACTION, SCALE_FACTOR, TENSOR_KINDS, Adversary, parse_adversary

SEED = 1234


def honest(seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, 32, generator=g) * 0.7 + 0.1  # (B, T, D)


def rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


def lie(kind: str, t: torch.Tensor, **kw: object) -> torch.Tensor:
    args = {"step": 3, "ticket": 1, "direction": "fwd"} | kw
    return Adversary(kind, seed=7).corrupt(t, **args)  # type: ignore[arg-type]


def test_scale_signflip_zero() -> None:
    t = honest()
    assert torch.equal(lie("scale", t), t * SCALE_FACTOR)
    assert torch.equal(lie("signflip", t), -t)
    z = lie("zero", t)
    assert z.shape == t.shape and not z.any()


def test_noise_adds_gaussian_of_the_tensors_rms() -> None:
    t = honest()
    d = lie("noise", t) - t
    assert abs(rms(d) / rms(t) - 1.0) < 0.05
    assert abs(float(torch.nn.functional.cosine_similarity(d.flatten(), t.flatten(), dim=0))) < 0.05


def test_random_keeps_the_norm_and_loses_the_direction() -> None:
    t = honest()
    r = lie("random", t)
    assert abs(rms(r) / rms(t) - 1.0) < 0.05
    assert abs(float(torch.nn.functional.cosine_similarity(r.flatten(), t.flatten(), dim=0))) < 0.05


def test_nan_poisons_a_fraction_and_keeps_the_rest() -> None:
    t = honest()
    n = lie("nan", t)
    bad = torch.isnan(n)
    assert int(bad.sum()) == round(NAN_FRACTION * t.numel())
    assert torch.equal(n[~bad], t[~bad])
    one = torch.ones(3)
    assert int(torch.isnan(lie("nan", one)).sum()) == 1  # at least one, even when 1% rounds to 0


@pytest.mark.parametrize("kind", ["noise", "random", "nan"])
def test_deterministic_per_seed_step_ticket_direction(kind: str) -> None:
    t = honest()
    a, b = lie(kind, t), lie(kind, t)
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    for other in ({"step": 4}, {"ticket": 2}, {"direction": "bwd"}):
        c = lie(kind, t, **other)
        assert not (torch.equal(a.nan_to_num(), c.nan_to_num()) and torch.equal(a.isnan(), c.isnan())), other
    c = Adversary(kind, seed=8).corrupt(t, step=3, ticket=1, direction="fwd")
    assert not torch.equal(a.nan_to_num(), c.nan_to_num())


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_input_untouched_and_global_rng_unused(kind: str) -> None:
    t = honest()
    before = t.clone()
    torch.manual_seed(99)
    expected = torch.rand(1)
    torch.manual_seed(99)
    out = lie(kind, t)
    assert torch.equal(t, before)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in TENSOR_KINDS])
def test_other_kinds_leave_tensors_alone(kind: str) -> None:
    t = honest()
    assert lie(kind, t) is t


def test_unknown_direction_is_refused() -> None:
    with pytest.raises(ValueError, match="direction"):
        lie("noise", honest(), direction="sideways")


def test_parse_still_needs_the_env_and_keeps_from_step() -> None:
    adv = parse_adversary("random:5", env={"PROTOLEARN_ALLOW_ADVERSARY": "1"})
    assert adv == Adversary("random", 5) and not adv.active(4) and adv.active(5) and adv.corrupts_tensors
    with pytest.raises(ConfigError):
        parse_adversary("random:5", env={})
