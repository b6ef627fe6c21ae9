"""The witness draw (coordinator/core/witnesses.py): who recomputes a spot-checked output is the coordinator's
keyed, fixed choice of a strict majority of the eligible replicas, so a minority of colluders can never frame."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from protolearn.coordinator.core.witnesses import Draws, draw, framing_chance, needed, witness_key

KEY = witness_key(b"k" * 32)
PEERS = [f"peer-{i:02d}" for i in range(20)]


@pytest.mark.parametrize(("eligible", "k"), [(0, 2), (1, 2), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (13, 7), (14, 8), (100, 8)])
def test_needed_is_a_strict_majority_from_2_to_8(eligible: int, k: int) -> None:
    assert needed(eligible) == k


def test_a_draw_is_fixed_by_the_check_and_the_key_and_spreads_over_checks() -> None:
    d = draw(KEY, "run", 3, 7, "fwd", "accused", PEERS[:5])
    assert len(d) == 3 and len(set(d)) == 3 and set(d) <= set(PEERS[:5])
    assert draw(KEY, "run", 3, 7, "fwd", "accused", reversed(PEERS[:5])) == d  # the order peers are listed in does not matter
    # Another key (another coordinator), or another check, draws otherwise; over many checks every peer is drawn.
    keys = [witness_key(bytes([i]) * 32) for i in range(30)]
    assert len({tuple(draw(k, "run", 3, 7, "fwd", "accused", PEERS[:5])) for k in keys}) > 1
    seen = {p for t in range(60) for p in draw(KEY, "run", 3, t, "fwd", "accused", PEERS[:5])}
    assert seen == set(PEERS[:5])
    assert draw(KEY, "run", 0, 0, "fwd", "a", ["only"]) == ["only"]  # too few to convict: the one there is
    assert draw(KEY, "run", 0, 0, "fwd", "a", []) == []


def test_a_minority_of_colluders_is_never_the_whole_draw() -> None:
    seed = 27
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(2000):
        stage = rng.randint(3, 17)  # the accused and its stage's other replicas (the reporter is in another stage)
        eligible = PEERS[: stage - 1]
        colluders = set(rng.sample(eligible, (stage - 1) // 2))  # a minority of the stage, the accused honest
        d = draw(witness_key(rng.randbytes(32)), "run", rng.randint(0, 99), rng.randint(0, 99), "bwd", "accused", eligible)
        if stage <= 16:
            assert not set(d) <= colluders
            assert framing_chance(len(eligible), len(colluders)) == 0.0
    # Past 2 x 8 replicas a minority can be 8 of the 8 drawn, rarely: the chance is the hypergeometric one.
    assert 0 < framing_chance(20, 9) == pytest.approx(9 / 125970)


def test_draws_are_remembered_and_bounded() -> None:
    draws = Draws(KEY, limit=3)
    first = draws.give("run", "rep", "acc", 1, 1, "fwd", PEERS[:4])
    assert draws.give("run", "rep", "acc", 1, 1, "fwd", PEERS[:9]) == first  # membership changed: the same draw
    assert draws.given("rep", "acc", 1, 1, "fwd") == first and draws.given("other", "acc", 1, 1, "fwd") is None
    for t in range(2, 5):
        draws.give("run", "rep", "acc", 1, t, "fwd", PEERS[:4])
    assert draws.given("rep", "acc", 1, 1, "fwd") is None  # the oldest is forgotten past the limit


def test_framing_bench_frames_nobody_below_a_majority_and_refuses_chosen_witnesses() -> None:
    """`python scripts/bench.py framing`: the real core against a Sybil reporter that attacks every ticket."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "scripts/bench.py", "framing", "--json", "--tickets", "500"],
                         capture_output=True, text=True, cwd=root, timeout=120, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["minority_never_framed"] is True and result["chosen_witnesses_refused"] is True
    rows = {(r["replicas"], r["sybils"]): r for r in result["layouts"]}
    assert rows[(5, 2)]["chosen_attempts"] > 0 and rows[(5, 2)]["framed"] == rows[(3, 1)]["framed"] == 0
