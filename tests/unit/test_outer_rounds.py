"""DiLoCo's outer-round decisions on the coordinator (coordinator/core/outer_rounds.py) on a fake clock.

The core decides, per stage and round, once a quorum arrived and the grace passed (or every live replica
arrived): who contributes with what weight (tokens from the coordinator's records, capped Throttle-style),
who follows, who is left out and why. Here: late arrivals, deaths before and after arriving, a replica
that comes back after being left out, a replica that lies about its token count, the cap, retries.
"""

from __future__ import annotations

import pytest

from protolearn.coordinator.core.outer_rounds import OuterRounds, OuterSpec, capped, quorum_wait_s

H = 4
TOKENS = 10  # per ticket


class Swarm:
    """The live replicas of stage 0 and the tickets each processed per step (what the ledger records)."""

    def __init__(self, *peers: str) -> None:
        self.live = set(peers)
        self.tickets: dict[tuple[str, int], int] = {}

    def processed(self, peer: str, stage: int, first: int, last: int) -> int:
        assert stage == 0
        return sum(self.tickets.get((peer, s), 0) for s in range(first, last + 1))

    def live_of(self, stage: int) -> set[str]:
        return set(self.live) if stage == 0 else set()

    def worked(self, peer: str, steps: range, per_step: int) -> None:
        for s in steps:
            self.tickets[(peer, s)] = per_step


def rounds(quorum: int = 2, grace_s: float = 2.0, share: float | None = None, steps: int = 0) -> OuterRounds:
    return OuterRounds(OuterSpec(inner_steps=H, steps=steps, quorum=quorum, grace_s=grace_s, max_weight_share=share, tokens_per_ticket=TOKENS), 1)


def arrive(r: OuterRounds, sw: Swarm, peer: str, now: float, round_: int = 1, attempt: int = 1, *, since: int = 0, claimed: int = 0):
    return r.arrive(peer, 0, round_, attempt, since_step=since, claimed=claimed, now=now, live=sw.live_of, processed=sw.processed)


def test_every_live_replica_arrived_decides_at_once_with_token_weights_from_the_records() -> None:
    sw = Swarm("a", "b")
    sw.worked("a", range(0, 4), 3)
    sw.worked("b", range(0, 4), 1)
    r = rounds(quorum=2)
    assert arrive(r, sw, "a", 0.0).role == "pending"
    got = arrive(r, sw, "b", 0.1)
    assert got.role == "participant"
    d = got.decision
    assert d is not None and d.weights == {"a": 120.0, "b": 40.0} and d.left_out == {} and d.quorum == 2
    assert "every live replica arrived" in d.reason
    # Asking again is idempotent: the same decision.
    assert arrive(r, sw, "a", 5.0).decision is d


def test_late_arrivals_wait_out_the_grace_then_are_left_out() -> None:
    sw = Swarm("a", "b", "c")
    for p in "abc":
        sw.worked(p, range(0, 4), 1)
    r = rounds(quorum=2, grace_s=2.0)
    assert arrive(r, sw, "a", 0.0).role == "pending"
    assert arrive(r, sw, "b", 0.5).role == "pending"  # quorum, but the grace runs from the first arrival
    assert r.tick(1.99, sw.live_of, sw.processed) == []
    (d,) = r.tick(2.0, sw.live_of, sw.processed)
    assert set(d.weights) == {"a", "b"} and d.left_out == {"c": "late: it had not arrived when the round was decided"}
    late = arrive(r, sw, "c", 2.5)
    assert late.role == "left_out" and "resync" in late.reason


def test_below_quorum_the_round_waits_past_the_grace_until_the_quorum_arrives() -> None:
    sw = Swarm("a", "b", "c")
    r = rounds(quorum=3, grace_s=1.0)
    arrive(r, sw, "a", 0.0)
    arrive(r, sw, "b", 0.1)
    assert r.tick(quorum_wait_s(1.0) - 0.5, sw.live_of, sw.processed) == []
    assert arrive(r, sw, "c", quorum_wait_s(1.0) - 0.4).role == "participant"


def test_a_replica_that_never_arrives_cannot_hold_its_stage_for_ever() -> None:
    sw = Swarm("a", "b", "hung")  # "hung" heartbeats, so it stays live, and never arrives
    r = rounds(quorum=3, grace_s=1.0)
    arrive(r, sw, "a", 0.0)
    arrive(r, sw, "b", 0.1)
    assert r.tick(quorum_wait_s(1.0) - 0.01, sw.live_of, sw.processed) == []
    (d,) = r.tick(quorum_wait_s(1.0), sw.live_of, sw.processed)
    assert set(d.weights) == {"a", "b"} and "hung" in d.left_out and "only 2 of quorum 3" in d.reason
    assert quorum_wait_s(1.0) == 5.0 and quorum_wait_s(3.0) == 12.0


def test_a_dead_replica_is_not_waited_for_and_one_that_arrived_then_died_is_left_out() -> None:
    sw = Swarm("a", "b", "c", "d")
    for p in "abcd":
        sw.worked(p, range(0, 4), 1)
    r = rounds(quorum=4, grace_s=60.0)
    arrive(r, sw, "a", 0.0)
    arrive(r, sw, "b", 0.1)
    arrive(r, sw, "c", 0.2)  # c arrives, then dies
    sw.live -= {"c", "d"}  # d died before arriving: the quorum shrinks to the live replicas
    (d,) = r.tick(0.3, sw.live_of, sw.processed)
    assert set(d.weights) == {"a", "b"} and d.quorum == 2
    assert d.left_out["c"].startswith("gone") and "d" not in d.left_out  # d is simply not live any more


def test_a_replica_that_comes_back_after_being_left_out_takes_part_weighted_by_what_it_did_since() -> None:
    sw = Swarm("a", "b")
    r = rounds(quorum=1, grace_s=0.5)
    for p in "ab":
        sw.worked(p, range(0, 8), 2)
    arrive(r, sw, "a", 0.0)
    r.tick(0.5, sw.live_of, sw.processed)  # b was slow: left out of round 1
    assert arrive(r, sw, "b", 0.6).role == "left_out"
    # b resynced to round 1's result and trains from step 6 on (it says so: since_step only lowers its weight).
    arrive(r, sw, "a", 10.0, round_=2)
    got = arrive(r, sw, "b", 10.1, round_=2, since=6)
    assert got.role == "participant"
    assert got.decision is not None and got.decision.weights == {"a": 80.0, "b": 40.0}


def test_a_replica_that_lies_about_its_tokens_gains_nothing() -> None:
    sw = Swarm("honest", "liar")
    sw.worked("honest", range(0, 4), 3)
    sw.worked("liar", range(0, 4), 1)
    r = rounds(quorum=2)
    arrive(r, sw, "honest", 0.0, claimed=120)
    # It claims a huge count, and a since_step before the round began: neither raises its weight.
    d = arrive(r, sw, "liar", 0.1, claimed=10**9, since=-100).decision
    assert d is not None and d.weights == {"honest": 120.0, "liar": 40.0}
    assert d.notes == ("liar claimed 1000000000 tokens, the records say 40",)


def test_a_replica_that_processed_nothing_follows_and_nobody_processing_anything_weighs_all_alike() -> None:
    sw = Swarm("a", "b")
    sw.worked("a", range(0, 4), 1)
    r = rounds(quorum=2)
    arrive(r, sw, "a", 0.0)
    got = arrive(r, sw, "b", 0.0)
    assert got.role == "follower" and got.decision is not None and got.decision.followers == ("b",)
    assert got.decision.weights == {"a": 40.0}
    quiet = rounds(quorum=2)
    arrive(quiet, Swarm("a", "b"), "a", 0.0)
    d = arrive(quiet, Swarm("a", "b"), "b", 0.0).decision
    assert d is not None and d.weights == {"a": 1.0, "b": 1.0}


def test_the_weight_cap_keeps_any_one_replica_from_dominating() -> None:
    sw = Swarm("fast", "b", "c")
    sw.worked("fast", range(0, 4), 8)
    sw.worked("b", range(0, 4), 1)
    sw.worked("c", range(0, 4), 1)
    r = rounds(quorum=3, share=0.5)
    arrive(r, sw, "fast", 0.0)
    arrive(r, sw, "b", 0.0)
    d = arrive(r, sw, "c", 0.0).decision
    assert d is not None
    total = sum(d.weights.values())
    assert d.weights["fast"] == pytest.approx(0.5 * total) and d.weights["b"] == d.weights["c"] == 40.0


@pytest.mark.parametrize(
    "weights, share, want",
    [
        ({"a": 10.0, "b": 1.0, "c": 1.0}, 0.5, {"a": 2.0, "b": 1.0, "c": 1.0}),
        ({"a": 10.0, "b": 9.0, "c": 1.0, "d": 1.0}, 0.3, {"a": 1.5, "b": 1.5, "c": 1.0, "d": 1.0}),
        ({"a": 1.0, "b": 1.0}, 0.4, {"a": 1.0, "b": 1.0}),  # no cap of 0.4 can hold for two: equal weights
        ({"a": 3.0, "b": 2.0, "c": 2.0}, 0.5, {"a": 3.0, "b": 2.0, "c": 2.0}),  # under the cap already
        ({"a": 5.0}, 0.1, {"a": 5.0}),
    ],
)
def test_capped(weights: dict[str, float], share: float, want: dict[str, float]) -> None:
    got = capped(weights, share)
    assert got == pytest.approx(want)
    if len(weights) * share >= 1:
        assert max(got.values()) <= share * sum(got.values()) + 1e-9


def test_a_failed_round_is_retried_as_the_next_attempt_and_older_attempts_are_stale() -> None:
    sw = Swarm("a", "b")
    r = rounds(quorum=2)
    arrive(r, sw, "a", 0.0)
    assert arrive(r, sw, "b", 0.0).role == "participant"
    # The collective failed on both: they ask again as attempt 2, a fresh decision.
    assert arrive(r, sw, "a", 1.0, attempt=2).role == "pending"
    d = arrive(r, sw, "b", 1.1, attempt=2).decision
    assert d is not None and d.attempt == 2 and set(d.weights) == {"a", "b"}
    assert arrive(r, sw, "b", 1.2, attempt=1).role == "left_out"  # attempt 1 is over
    assert arrive(r, sw, "a", 1.3, round_=1, attempt=2).decision is d


def test_the_last_round_ends_at_the_runs_last_step() -> None:
    spec = OuterSpec(inner_steps=4, steps=10)
    assert [spec.boundary(r) for r in (1, 2, 3)] == [3, 7, 9]
    assert OuterSpec(inner_steps=4).boundary(3) == 11
