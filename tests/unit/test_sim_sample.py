"""The simulator's sampler of route candidates draws what ``random.Random.sample`` draws (a seeded run must not
change with it), for populations on both sides of CPython's switch between its two methods."""

from __future__ import annotations

import random

import pytest
from protolearn.sim.pipeline import sample


@pytest.mark.parametrize(("n", "k"), [(n, k) for n in (16, 17, 40, 85, 86, 87, 312, 5000) for k in (1, 5, 6, 16, 64) if k <= n])
def test_the_sampler_draws_what_random_sample_draws_from_the_same_stream(n: int, k: int) -> None:
    population = [f"peer{i}" for i in range(n)]
    ours, theirs = random.Random(1234 + n + k), random.Random(1234 + n + k)
    for _ in range(50):
        assert sample(ours, population, k) == theirs.sample(population, k)
    assert ours.random() == theirs.random()  # and left the stream where it leaves it
