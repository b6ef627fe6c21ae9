"""Stage assignment and rebalancing: joiners fill the weakest stage, moves only when they pay off."""

from __future__ import annotations

import random
import time

from hypothesis import example, given, settings
from hypothesis import strategies as st
from protolearn.coordinator.core.assignment import (
    MAX_CLAIM,
    StageLoad,
    ThroughputClaims,
    balance_quality,
    choose_stage,
    propose_move,
    shares_from_layers,
    stage_loads,
)
from protolearn.protocol import coordination as cm


def test_joiner_goes_to_the_stage_with_least_throughput_per_share() -> None:
    shares = shares_from_layers([2, 1])  # stage 0 has twice the layers, so it needs twice the compute
    loads = [StageLoad(150.0, 2), StageLoad(100.0, 1)]
    # per share: stage 0 = 150 / (2/3) = 225, stage 1 = 100 / (1/3) = 300
    assert choose_stage(loads, shares).stage == 0


def test_empty_stage_is_filled_first_and_reason_says_why() -> None:
    shares = shares_from_layers([1, 1, 1])
    choice = choose_stage([StageLoad(50.0, 1), StageLoad(0.0, 0), StageLoad(10.0, 1)], shares)
    assert choice.stage == 1
    assert "no replicas" in choice.reason


def test_first_joiners_spread_over_every_stage() -> None:
    shares = shares_from_layers([1, 1, 1, 1])
    nodes: list[tuple[int, float]] = []
    for _ in range(4):
        stage = choose_stage(stage_loads(nodes, 4), shares).stage
        nodes.append((stage, 100.0))
    assert sorted(s for s, _ in nodes) == [0, 1, 2, 3]


def test_balanced_swarm_proposes_no_move() -> None:
    shares = shares_from_layers([2, 2])
    nodes = [("a", 0, 100.0, True), ("b", 0, 100.0, True), ("c", 1, 100.0, True), ("d", 1, 90.0, True)]
    assert propose_move(nodes, shares, min_quality=0.75) is None


def test_move_from_over_to_under_provisioned_stage_when_it_improves_enough() -> None:
    shares = shares_from_layers([1, 1])
    nodes = [("a", 0, 100.0, True), ("b", 0, 100.0, True), ("c", 0, 100.0, True), ("d", 1, 50.0, True)]
    move = propose_move(nodes, shares, min_quality=0.75)
    assert move is not None
    assert (move.src, move.dst) == (0, 1)
    assert move.quality_after > move.quality_before
    assert "stage 0" in move.reason and "stage 1" in move.reason


def test_small_improvement_below_threshold_is_not_worth_a_move() -> None:
    shares = shares_from_layers([1, 1])
    # Rate is 100 now; the best move (a 30 into stage 1) gives min(170, 130) = 130 < 100 / 0.75.
    nodes = [("a", 0, 30.0, True), ("b", 0, 170.0, True), ("c", 1, 100.0, True)]
    assert propose_move(nodes, shares, min_quality=0.75) is None
    assert propose_move(nodes, shares, min_quality=0.99) is not None


def test_never_empties_a_stage_and_respects_immovable_nodes() -> None:
    shares = shares_from_layers([1, 1, 1])
    # Stage 2 is empty; stage 0 has a single replica (must stay), stage 1 has one movable of two.
    nodes = [("a", 0, 500.0, True), ("b", 1, 100.0, False), ("c", 1, 100.0, True)]
    move = propose_move(nodes, shares)
    assert move is not None and move.peer_id == "c" and move.dst == 2
    assert propose_move([("a", 0, 500.0, True), ("b", 1, 100.0, True)], shares) is None


def test_ten_thousand_nodes_decide_in_under_a_second() -> None:
    rng = random.Random(0)
    num_stages = 8
    shares = shares_from_layers([rng.randint(1, 4) for _ in range(num_stages)])
    nodes = [(f"peer{i}", rng.randrange(num_stages), rng.uniform(10, 1000), True) for i in range(10_000)]
    # Make one stage clearly under-provisioned so a move exists.
    nodes = [(p, 3 if s == 3 and rng.random() < 0.9 else s, t, m) if s != 3 else (p, 2, t, m) for p, s, t, m in nodes]
    nodes.append(("lonely", 3, 10.0, True))
    t0 = time.perf_counter()
    stage = choose_stage(stage_loads(((s, t) for _, s, t, _ in nodes), num_stages), shares).stage
    t1 = time.perf_counter()
    move = propose_move(nodes, shares)
    t2 = time.perf_counter()
    assert stage == 3
    assert move is not None and move.dst == 3
    assert t1 - t0 < 1.0, f"join decision took {t1 - t0:.3f} s"
    assert t2 - t1 < 1.0, f"rebalance decision took {t2 - t1:.3f} s"
    assert balance_quality(stage_loads(((s, t) for _, s, t, _ in nodes), num_stages), shares) < move.quality_after


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1e-3, max_value=MAX_CLAIM), min_size=1, max_size=40), st.integers(0, 39))
def test_the_binned_median_claim_is_within_one_bin_of_the_true_lower_median(claims: list[float], drop: int) -> None:
    c = ThroughputClaims()
    for t in claims:
        c.add(t)
    if len(claims) > 1:  # take one out again, as a leaving member does
        c.add(claims.pop(drop % len(claims)), -1)
    true = sorted(claims)[(len(claims) - 1) // 2]
    median = c.lower_median()
    assert median is not None and true <= median <= true * 2 ** 0.25 * (1 + 1e-9)
    # A claim counts as at most factor times that median; smaller claims count as made.
    assert c.bound(1e15, 4.0) == min(1e15, 4.0 * median) and c.bound(true, 4.0) == true


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(min_value=1e-3, max_value=MAX_CLAIM), st.integers(0, 10**6)), max_size=80))
def test_the_median_kept_as_claims_come_and_go_is_the_one_a_scan_of_the_bins_finds(changes: list[tuple[bool, float, int]]) -> None:
    """Members join, change their claims and leave in any order: after every change the median bin kept
    incrementally is the one a scan of the bins finds, and it holds the true lower median."""
    from protolearn.coordinator.core.assignment import MIN_THROUGHPUT, _BINS_PER_DOUBLING

    c, held = ThroughputClaims(), []
    for take_out, t, k in changes:
        if take_out and held:
            c.add(held.pop(k % len(held)), -1)
        else:
            c.add(t)
            held.append(t)
        assert c.count == len(held)
        if not held:
            assert c.lower_median() is None
            continue
        rank, seen = (len(held) - 1) // 2, 0
        for i, n in enumerate(c._bins):
            seen += n
            if seen > rank:
                break
        assert c.lower_median() == MIN_THROUGHPUT * 2 ** ((i + 1) / _BINS_PER_DOUBLING)
        true = sorted(held)[rank]
        assert true <= c.lower_median() <= true * 2 ** 0.25 * (1 + 1e-9)


def test_with_no_claims_there_is_no_reference_and_a_claim_counts_as_made() -> None:
    c = ThroughputClaims()
    c.add(0.0)  # not measured yet: not a claim
    assert c.count == 0 and c.lower_median() is None and c.bound(1e15, 4.0) == 1e15


def test_a_joiner_cannot_choose_among_near_least_loaded_stages_the_coordinator_draws() -> None:
    """Issue 27, rule 6: among stages within PLACEMENT_SLACK of the least loaded (once it has
    PLACEMENT_DRAW_MIN_REPLICAS replicas) the coordinator's keyed draw picks; a stage past the slack is never
    drawn, and small stages fill in order."""
    from protolearn.coordinator.core.assignment import PLACEMENT_DRAW_MIN_REPLICAS, PLACEMENT_SLACK

    shares = [1.0, 1.0, 1.0]
    n = PLACEMENT_DRAW_MIN_REPLICAS
    balanced = [StageLoad(100.0 * n, n), StageLoad(100.0 * n, n), StageLoad(100.0 * n * (1 + PLACEMENT_SLACK) * 1.01, n + 1)]
    seen = {choose_stage(balanced, shares, pick=lambda c, k=k: k).stage for k in range(12)}
    assert seen == {0, 1}, "the draw spans the near-least stages, never one past the slack"
    assert "drawn among the 2 stages" in choose_stage(balanced, shares, pick=lambda c: 1).reason
    small = [StageLoad(100.0, 1), StageLoad(100.0, 1), StageLoad(100.0, 1)]
    assert {choose_stage(small, shares, pick=lambda c, k=k: k).stage for k in range(6)} == {0}, "small stages fill in order"
    empty = [StageLoad(400.0, 4), StageLoad(0.0, 0), StageLoad(400.0, 4)]
    assert choose_stage(empty, shares, pick=lambda c: 0).stage == 1, "an empty stage always comes first"


def test_identities_that_leave_whenever_placed_off_target_land_in_it_at_the_draws_rate_and_cannot_crowd_it() -> None:
    """Stage steering with the real coordinator core: a Sybil pool joins, keeps an identity only when the
    coordinator placed it in the target stage, and leaves otherwise. The draw makes it pay about one join per
    candidate stage for each landing, and the balancer's slack bounds how far the target can outgrow the rest."""
    from protolearn.coordinator.core.assignment import PLACEMENT_SLACK
    from tests.support.coordinator import join, make_core, run_info

    core = make_core(run_info(3))
    for k in range(12):  # four honest replicas per stage
        join(core, f"honest{k}")
    target, kept, tries = 2, [], 0
    for k in range(60):
        tries += 1
        if join(core, f"sybil{k}", 1.0).stage == target:
            kept.append(k)
        else:
            core.handle(f"sybil{k}", cm.Leave(reason="not the stage I wanted"), 1.0)
    loads = [load.replicas for load in core.registry.loads()]
    assert loads[target] <= (1 + PLACEMENT_SLACK) * min(loads) + 1, loads
    assert 0 < len(kept) < tries, f"{len(kept)} of {tries} joins landed in the target: the joiner cannot choose"


def test_identities_that_claim_almost_no_throughput_cannot_crowd_a_stage_by_leaving_either() -> None:
    """The abuse bench's stage_steering (issue 27, rule 6): the slack was in throughput only, and identities that
    claim almost none never move a stage's throughput, so the target stayed a candidate of every draw and the
    pool kept 7 of its 9 replicas after 12 joins (and 36 of 38 after 60). The draw's candidates are near the
    least loaded in replicas per share too, so the bound on replicas holds whatever the claims."""
    from protolearn.coordinator.core.assignment import PLACEMENT_SLACK
    from tests.support.coordinator import join, make_core, run_info

    core = make_core(run_info(3))
    for k in range(12):  # four honest replicas per stage
        join(core, f"honest{k}")
    target, kept = 2, []
    for k in range(60):
        # The pool keeps one identity off target per stage, so that every stage has the draw's replicas.
        if join(core, f"sybil{k}", 1.0, throughput=1e-3).stage == target or k < 2:
            kept.append(k)
        else:
            core.handle(f"sybil{k}", cm.Leave(reason="not the stage I wanted"), 1.0)
        loads = [load.replicas for load in core.registry.loads()]
        assert loads[target] <= (1 + PLACEMENT_SLACK) * min(loads) + 1, (k, loads)


def test_a_stage_least_in_throughput_but_crowded_in_replicas_takes_no_joiner() -> None:
    """The abuse bench's stage_steering with low claims (issue 27, rule 6): identities claiming almost no throughput
    in the target kept it the least loaded in throughput, and the least loaded stage was a candidate whatever its
    replicas, so the target got every join and held 5 replicas to the other stage's 4. A stage past the slack in
    replicas per share is never a candidate while another stage has fewer; small stages still fill by throughput."""
    from protolearn.coordinator.core.assignment import PLACEMENT_SLACK

    shares = [1.0, 1.0]
    crowded = [StageLoad(400.0, 4), StageLoad(300.0 + 1e-3, 4 + int(4 * PLACEMENT_SLACK) + 1)]
    assert {choose_stage(crowded, shares, pick=lambda c, k=k: k).stage for k in range(6)} == {0}
    assert choose_stage(crowded, shares).stage == 0
    within = [StageLoad(400.0, 4), StageLoad(300.0, 5)]  # 5 <= 1.25 * 4: throughput decides
    assert choose_stage(within, shares).stage == 1
    small = [StageLoad(200.0, 2), StageLoad(100.0, 1 + 2)]  # below the draw's replicas: throughput decides
    assert choose_stage(small, shares).stage == 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 1e-9, 0.5, 1.0, 3.0, 100.0, 1234.5678, 1e6]), st.booleans()), max_size=40),
    st.lists(st.sampled_from([1.0, 2.0, 3.0, 0.5]), min_size=4, max_size=4),
    st.sampled_from([0.5, 0.75, 0.9, 0.99, 1.0]),
)
# Near the bar: the bottleneck stage 3 is at 0.95 of the mean rate, and moving the 5 from stage 0 evens every stage.
@example([(s, 10.0, True) for s in range(4) for _ in range(10) if (s, _) != (3, 0)] + [(0, 5.0, True), (3, 5.0, True)], [1.0] * 4, 0.99)
def test_the_tallies_skip_a_rebalance_scan_only_where_it_would_propose_no_move(nodes, weights, quality) -> None:
    """Registry.rebalance skips its scan of every member when the tallies say no move can pass the quality bar
    (StageTallies.could_rebalance): that must never skip a move the scan proposes."""
    from protolearn.coordinator.core.members import Member
    from protolearn.coordinator.core.tallies import StageTallies

    shares = [w / sum(weights) for w in weights]
    members = [
        Member(peer_id=f"p{i}", addrs=[], device="cpu", memory_gb=1.0, throughput=t, stage=s, joined_at=0.0, last_seen=0.0)
        for i, (s, t, _) in enumerate(nodes)
    ]
    tallies = StageTallies(4, members)
    move = propose_move(((m.peer_id, m.stage, m.throughput, movable) for m, (_, _, movable) in zip(members, nodes)), shares,
                        min_quality=quality)
    if not tallies.could_rebalance(shares, quality):
        assert move is None
