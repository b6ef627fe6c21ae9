"""The spot-check rate: 1.0 for newcomers, halving per half-life of passes to the floor; suspects and failures at 1.0."""

from __future__ import annotations

import random

import pytest

from protolearn.protocol.probation import SpotCheckPolicy

SEED = 11


def policy(rate: float = 0.05, half_life: int = 4, **kw: int) -> SpotCheckPolicy:
    return SpotCheckPolicy(rate=rate, half_life=half_life, rng=random.Random(SEED), **kw)


def test_newcomer_is_always_checked() -> None:
    p = policy()
    assert p.rate("new") == 1.0 and p.state("new") == "probation"
    assert all(p.should_check("new") for _ in range(100))
    assert len(p) == 0  # asking remembers nothing


def test_rate_halves_every_half_life_down_to_the_floor() -> None:
    p = policy(rate=0.05, half_life=4)
    seen = []
    for _ in range(40):
        seen.append(p.rate("a"))
        p.passed("a")
    assert seen[:4] == [1.0] * 4 and seen[4:8] == [0.5] * 4 and seen[8:12] == [0.25] * 4
    assert seen[16:20] == [0.0625] * 4 and seen[20] == 0.05  # 1/32 < 0.05: the floor
    assert p.rate("a") == 0.05 and p.state("a") == "trusted"


def test_trusted_peer_is_checked_at_about_the_floor_rate() -> None:
    p = policy(rate=0.1, half_life=1)
    for _ in range(10):
        p.passed("a")
    n = 20_000
    hits = sum(p.should_check("a") for _ in range(n))
    assert abs(hits / n - 0.1) < 0.01, f"seed {SEED}: {hits}/{n}"


def test_suspect_is_always_checked() -> None:
    p = policy(rate=0.0, half_life=1)
    for _ in range(30):
        p.passed("a")
    assert p.state("a") == "trusted" and not any(p.should_check("a") for _ in range(100))
    assert all(p.should_check("a", suspect=True) for _ in range(100))


def test_failure_resets_to_one_and_is_remembered_for_a_half_life() -> None:
    p = policy(rate=0.05, half_life=4)
    for _ in range(30):
        p.passed("a")
    assert p.state("a") == "trusted"
    p.failed("a")
    assert p.rate("a") == 1.0 and p.state("a") == "failed"
    for _ in range(3):
        p.passed("a")
        assert p.state("a") == "failed" and p.rate("a") == 1.0
    p.passed("a")
    assert p.state("a") == "probation" and p.rate("a") == 1.0  # decays from 1.0 again
    for _ in range(4):
        p.passed("a")
    assert p.rate("a") == 0.5


def test_forget_makes_a_newcomer() -> None:
    p = policy(half_life=1)
    for _ in range(10):
        p.passed("a")
    p.forget("a")
    p.forget("never-seen")
    assert p.rate("a") == 1.0 and len(p) == 0


def test_memory_is_bounded_and_least_recent_forgotten() -> None:
    p = policy(rate=0.05, half_life=1, max_peers=3)
    for peer in "abc":
        for _ in range(10):
            p.passed(peer)
    p.passed("a")  # a is now the most recent; b the oldest
    p.failed("d")
    assert len(p) == 3
    assert p.rate("b") == 1.0 and p.state("b") == "probation"  # forgotten: a newcomer again
    assert p.rate("a") == 0.05 and p.rate("c") == 0.05 and p.state("d") == "failed"


@pytest.mark.parametrize("bad", [{"rate": 1.5}, {"rate": -0.1}, {"half_life": 0}, {"max_peers": 0}])
def test_bad_parameters_are_refused(bad: dict[str, float]) -> None:
    args: dict[str, object] = {"rate": 0.05, "half_life": 4, "rng": random.Random(SEED)} | bad
    with pytest.raises(ValueError):
        SpotCheckPolicy(**args)  # type: ignore[arg-type]
