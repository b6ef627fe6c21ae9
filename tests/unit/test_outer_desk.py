"""DiLoCo's outer rounds through the real coordinator core (coordinator/core/outer_desk.py): what an arrival
must be before it counts, the weights from the coordinator's own routes, the outer_hold strikes, and the
decisions surviving a restart from SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.outer_rounds import OuterSpec
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.store import Store
from protolearn.protocol import coordination as cm
from tests.support.coordinator import join, make_core, run_info, run_step, verify_test_ack

H = 2
SETTINGS = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=30.0, lease_s=10.0, rate_per_s=1e6, rate_burst=1e6)


def core_with(quorum: int = 2, grace_s: float = 1.0, settings: CoordinatorSettings = SETTINGS):
    run = run_info(outer=OuterSpec(inner_steps=H, steps=10, quorum=quorum, grace_s=grace_s, tokens_per_ticket=100))
    core = make_core(run, settings, verify=verify_test_ack)
    for p in ("a0", "a1", "b0", "b1"):
        join(core, p)
    by = {s: sorted(p for p, m in core.registry.members.items() if m.stage == s) for s in (0, 1)}
    for p in by[0] + by[1]:
        core.handle(p, cm.Heartbeat(state="training", stage=core.registry.members[p].stage), 0.0)
    return core, by


def ready(core, peer: str, round_: int, now: float, **kw) -> cm.OuterDecision:
    stage = core.registry.members[peer].stage
    reply = core.handle(peer, cm.OuterReady(stage=stage, round=round_, **kw), now)
    assert isinstance(reply, cm.OuterDecision)
    return reply


def commit_round(core, by, round_: int, now: float) -> None:
    """The round's H inner steps: every ticket leased by stage 0's first replica and routed through stage 1's
    first; every live replica then reports the step to the commit barrier, as an inner step's replicas do."""
    for _ in range(H):
        step = core.ledger.step
        run_step(core, by[0][0], by[1][0], now, commit=False)
        for p in by[0] + by[1]:
            if not core.verdicts.is_banned(p):
                core.handle(p, cm.Averaged(step=step, revision=core.ledger.closed[step].revision, result_hash="inner"), now)
        assert core.ledger.committed(step)


def test_an_arrival_before_its_boundary_committed_or_for_another_stage_is_refused() -> None:
    core, by = core_with()
    with pytest.raises(Refusal, match="has not committed"):
        ready(core, by[0][0], 1, 1.0)
    commit_round(core, by, 1, 1.0)
    with pytest.raises(Refusal, match="serves stage"):
        core.handle(by[0][0], cm.OuterReady(stage=1, round=1), 1.0)
    with pytest.raises(Refusal, match="end before outer round"):
        ready(core, by[0][0], 6, 1.0)


def test_weights_come_from_the_routes_and_the_replica_that_routed_nothing_follows() -> None:
    core, by = core_with()
    commit_round(core, by, 1, 1.0)
    assert ready(core, by[1][0], 1, 2.0, tokens=10**9).role == "pending"  # its claim of tokens is never used
    got = ready(core, by[1][1], 1, 2.1)
    assert got.role == "follower"
    assert [(w.peer_id, w.weight) for w in got.weights] == [(by[1][0], H * 4 * 100.0)]
    d = core.outer.last(1)
    assert d.notes and "records say 800" in d.notes[0]


def test_a_replica_whose_anchor_is_not_its_stages_majority_or_that_missed_the_round_is_left_out() -> None:
    core, by = core_with()
    commit_round(core, by, 1, 1.0)
    ready(core, by[0][0], 1, 2.0)
    ready(core, by[0][1], 1, 2.0)
    # Both synced round 1 and report its state; then round 2's steps commit.
    for p in by[0]:
        core.handle(p, cm.Heartbeat(state="training", stage=0, step=H - 1, param_hash="anchor1"), 3.0)
    commit_round(core, by, 2, 4.0)
    got = ready(core, by[0][0], 2, 5.0, anchor_hash="something-else")
    assert got.role == "left_out" and "anchor1"[:12] in got.reason
    # Once a majority reports the state after round 2, an arrival for round 2 is too late, whatever it holds.
    for p in by[0]:
        core.handle(p, cm.Heartbeat(state="training", stage=0, step=2 * H - 1, param_hash="anchor2"), 6.0)
    got = ready(core, by[0][1], 2, 6.5, anchor_hash="anchor1")
    assert got.role == "left_out" and "already hold the state after outer round 2" in got.reason


def test_a_live_replica_that_never_arrives_is_struck_each_round_and_expelled() -> None:
    settings = SETTINGS.model_copy(update={"expel_after_strikes": 2})
    core, by = core_with(quorum=1, grace_s=1.0, settings=settings)
    hung, honest = by[1][1], by[1][0]
    now = 1.0
    for round_ in (1, 2):
        commit_round(core, by, round_, now)
        for p in by[0] + [honest]:
            ready(core, p, round_, now)
        now += 1.5
        core.housekeeping(now)  # the grace ran out: the round goes ahead without it
        for p in by[0] + by[1]:
            if not core.verdicts.is_banned(p):
                core.handle(p, cm.Heartbeat(state="training", stage=core.registry.members[p].stage), now)
        if round_ == 1:
            assert core.verdicts.flags_of(hung) == ["outer_hold:1"] and not core.verdicts.is_banned(hung)
    assert core.verdicts.is_banned(hung) and "missed 2 outer rounds" in core.verdicts.bans[hung].reason
    assert not core.verdicts.is_banned(honest)


def test_decisions_survive_a_coordinator_restart(tmp_path: Path) -> None:
    core, by = core_with()
    commit_round(core, by, 1, 1.0)
    ready(core, by[1][0], 1, 2.0)
    first = ready(core, by[1][1], 1, 2.0)
    store = Store(tmp_path)
    store.apply(core.drain())
    again = make_core(core.run, SETTINGS, verify=verify_test_ack)
    again.restore(**store.load(), now=10.0)
    store.close()
    for p in by[0] + by[1]:
        again.handle(p, cm.Heartbeat(state="training", stage=again.registry.members[p].stage), 10.0)
    # A participant that asks again after the restart is told what the others were told.
    assert ready(again, by[1][1], 1, 10.5) == first


def test_a_slow_replica_that_arrives_late_is_not_expelled() -> None:
    settings = SETTINGS.model_copy(update={"expel_after_strikes": 2})
    core, by = core_with(quorum=1, grace_s=1.0, settings=settings)
    slow = by[1][1]
    now = 1.0
    for round_ in (1, 2, 3):
        commit_round(core, by, round_, now)
        for p in by[0] + [by[1][0]]:
            ready(core, p, round_, now)
        now += 1.5
        core.housekeeping(now)  # the round went ahead without the slow one: a strike
        assert ready(core, slow, round_, now).role == "left_out"  # it does arrive, late: it resyncs, strikes cleared
        for p in by[0] + by[1]:
            core.handle(p, cm.Heartbeat(state="training", stage=core.registry.members[p].stage), now)
    assert not core.verdicts.is_banned(slow)
