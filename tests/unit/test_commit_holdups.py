"""No single replica holds the commit for ever (coordinator/core/holdups.py): a replica that never reports
a closed step's result, while the rest of its stage has, is no longer waited for after its grace, is
struck once per grace whoever else is leasing, and is expelled after ``expel_after_strikes`` graces."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.status import build_status
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from tests.support.coordinator import STEP_SETTINGS, TEST_ACK, join
from tests.support.coordinator import default_core as make_core

GRACE = STEP_SETTINGS.commit_grace_s


def _members(core: CoordinatorCore, names: str) -> dict[int, list[str]]:
    by_stage: dict[int, list[str]] = {}
    for p in names:
        by_stage.setdefault(join(core, p).stage, []).append(p)
    return by_stage


def _beat(core: CoordinatorCore, now: float) -> None:
    """Every live member heartbeats as a training replica (a hung device's node still does)."""
    for m in list(core.registry.live()):
        core.handle(m.peer_id, cm.Heartbeat(state="training", stage=m.stage), now)


def _close(core: CoordinatorCore, s0: str, s1: str, now: float) -> int:
    B = core.run.microbatches_per_step
    step = core.ledger.step
    while core.ledger.step == step:
        for i in core.handle(s0, cm.Lease(max_tickets=B), now).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0, s1], loss=1.0), now)
    return step


def _report(core: CoordinatorCore, step: int, peers: Iterable[str], now: float) -> None:
    """Each of ``peers`` reports holding the step's result (the same, empty hash)."""
    for p in peers:
        core.handle(p, cm.Averaged(step=step, revision=1), now)


def _five_with_a_stage_of_three(core: CoordinatorCore) -> tuple[dict[int, list[str]], int, int]:
    """Five members (a stage of three and one of two), all training, and step 0 closed: (stages, the
    stage of three, the step)."""
    stages = _members(core, "abcde")
    three = next(s for s, peers in stages.items() if len(peers) == 3)
    _beat(core, 0.1)
    return stages, three, _close(core, stages[0][0], stages[1][0], 0.2)


def _wait(core: CoordinatorCore, until: float, now: float) -> float:
    """Heartbeats and housekeeping every 0.25 s from ``now`` to ``until`` (nobody leases meanwhile)."""
    while now < until:
        now += 0.25
        _beat(core, now)
        core.housekeeping(now)
    return now


def test_a_holdout_in_a_stage_of_three_is_excused_after_its_grace_and_struck_once() -> None:
    core = make_core()
    stages, three, step = _five_with_a_stage_of_three(core)
    hung = stages[three][-1]
    _report(core, step, [p for peers in stages.values() for p in peers if p != hung], 0.3)
    now = _wait(core, 0.3 + GRACE - 0.5, 0.3)
    assert not core.ledger.committed(step), "within its grace the commit waits for it"
    assert core.holdups.waiting is not None and core.holdups.waiting.peer == hung and core.holdups.waiting.stage == three
    now = _wait(core, 0.3 + GRACE + 0.5, now)
    assert core.ledger.committed(step), "two of three agree and the third held it a grace: the step commits"
    assert core.verdicts.flags_of(hung) == ["commit_hold:1"]
    assert all(not core.verdicts.flags_of(p) for peers in stages.values() for p in peers if p != hung)
    # It comes back with the committed result: accepted, and its count clears.
    assert core.handle(hung, cm.Averaged(step=step, revision=1), now + 0.1).committed
    assert hung not in core.holdups._struck


def test_a_participant_holdout_in_a_stage_of_two_is_expelled_after_its_graces_and_the_step_then_commits() -> None:
    # Stage 1's tickets are split between its two replicas: both contributed to the round, so the one
    # that reported is no majority alone, and only the other's expulsion lets the step commit.
    core = make_core()
    (s0, s0b), (s1, hung) = _members(core, "abcd").values()
    _beat(core, 0.1)
    B = core.run.microbatches_per_step
    step = core.ledger.step
    while core.ledger.step == step:
        for i in core.handle(s0, cm.Lease(max_tickets=B), 0.2).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0, hung if i % 2 else s1], loss=1.0), 0.2)
    _report(core, step, (s0, s0b, s1), 0.3)
    limit = STEP_SETTINGS.expel_after_strikes
    assert limit is not None
    now = _wait(core, 0.3 + (limit - 1) * GRACE + 0.5, 0.3)
    assert not core.ledger.committed(step), "one of two contributors is no majority: only the expulsion lets it commit"
    assert core.verdicts.flags_of(hung) == [f"commit_hold:{limit - 1}"] and not core.verdicts.is_banned(hung)
    status = build_status(core, now)
    assert status.verdict == "degraded" and f"waits on stage 1 replica {hung[-8:]}" in status.verdict_reason, status.verdict_reason
    now = _wait(core, 0.3 + limit * GRACE + 0.5, now)
    assert core.verdicts.is_banned(hung)
    assert core.verdicts.bans[hung].reason.startswith("liveness: held the commit of step 0")
    assert core.ledger.committed(step)
    assert not any(core.verdicts.is_banned(p) or core.verdicts.flags_of(p) for p in (s0, s0b, s1))


def test_a_stage_whose_round_lost_a_banned_participant_gets_twice_the_graces() -> None:
    """Costs go to their cause: the liar of a stage was convicted while its stage averaged the step, and the
    survivors' round waited out its timeouts; an honest survivor was expelled for holding the commit. Such a
    stage's holdouts are expelled only after twice the strikes: a bound still, and a later report clears."""
    core = make_core()
    stages = _members(core, "abcdef")
    assert len(stages[1]) == 3, stages
    three, other = 1, 0
    _beat(core, 0.1)
    B = core.run.microbatches_per_step
    step = core.ledger.step
    s0 = stages[0][0]
    liar, slow, fine = stages[1]
    # Every replica of stage 1 took part in the step (ticket i goes through stage-1 replica i % 3).
    while core.ledger.step == step:
        for i in core.handle(s0, cm.Lease(max_tickets=B), 0.2).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0, stages[1][i % 3]], loss=1.0), 0.2)
    account = core.ledger.closed[step].accounting()
    assert set(account[three]) == {liar, slow, fine}
    core.ban(liar, "integrity: convicted", 0.25)  # mid-round
    _report(core, step, stages[other], 0.3)  # the other stage reported; this one's round is still running
    limit = STEP_SETTINGS.expel_after_strikes
    assert limit is not None
    now = _wait(core, 0.3 + limit * GRACE + 0.5, 0.3)
    assert not core.verdicts.is_banned(slow) and not core.verdicts.is_banned(fine), core.verdicts.bans
    assert core.verdicts.flags_of(slow) == [f"commit_hold:{limit}"]
    _report(core, step, [fine], now)  # one survivor finishes the round
    now = _wait(core, 0.3 + 2 * limit * GRACE + 0.5, now)
    assert core.verdicts.is_banned(slow), "still a bound: twice the graces, then the holdout goes"
    assert not core.verdicts.is_banned(fine)


def test_a_left_out_holdout_in_a_stage_of_two_no_longer_counts_after_its_grace() -> None:
    # Every stage-0 ticket went through s0: its partner took part in nothing and holds nothing of the
    # step, so once it held the commit a grace the stage's count is s0 alone.
    core = make_core()
    (s0, hung), (s1, s1b) = _members(core, "abcd").values()
    _beat(core, 0.1)
    step = _close(core, s0, s1, 0.2)
    _report(core, step, (s0, s1, s1b), 0.3)
    now = _wait(core, 0.3 + GRACE - 0.5, 0.3)
    assert not core.ledger.committed(step)
    now = _wait(core, 0.3 + GRACE + 0.5, now)
    assert core.ledger.committed(step) and core.verdicts.flags_of(hung) == ["commit_hold:1"]
    assert core.handle(hung, cm.Averaged(step=step, revision=1), now).committed  # it fetched the result after all


def test_a_stage0_replica_that_sat_on_its_leases_is_not_waited_for_at_all() -> None:
    # The coordinator saw it hold leases of the step while its partner completed tickets (a liveness
    # strike ended them): it processed nothing of the step, so the commit does not wait for it.
    core = make_core()
    (s0, hung), (s1, s1b) = _members(core, "abcd").values()
    _beat(core, 0.1)
    B = core.run.microbatches_per_step
    step = core.ledger.step
    held = core.handle(hung, cm.Lease(max_tickets=B), 0.2).indices
    assert held
    now = 0.2
    while core.ledger.step == step and now < 30:
        now += 0.25
        _beat(core, now)
        core.housekeeping(now)
        for i in core.handle(s0, cm.Lease(max_tickets=B), now).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0, s1], loss=1.0), now)
    assert core.ledger.step == step + 1, "the others closed the step"
    assert "late_leases:1" in core.verdicts.flags_of(hung)
    _report(core, step, (s0, s1, s1b), now)
    now = _wait(core, now + 0.5, now)
    assert core.ledger.committed(step), "committed within a housekeeping pass, not after a grace"
    assert not any(f.startswith("commit_hold") for f in core.verdicts.flags_of(hung))
    # Nor on the next step, which it never leased: it has not reported since.
    step = _close(core, s0, s1, now)
    _report(core, step, (s0, s1, s1b), now)
    now = _wait(core, now + 0.5, now)
    assert core.ledger.committed(step)


def test_nobody_is_struck_while_more_than_one_replica_of_the_stage_has_not_reported() -> None:
    # The clock starts only once every other live replica holds one result: a stage whose round is still
    # running (or failed for all) strikes nobody, however long it takes.
    core = make_core()
    stages, three, step = _five_with_a_stage_of_three(core)
    _report(core, step, [p for s, peers in stages.items() if s != three for p in peers], 0.3)
    core.handle(stages[three][0], cm.Averaged(step=step, revision=1), 0.3)
    _wait(core, 0.3 + 3 * GRACE, 0.3)
    assert not core.ledger.committed(step)
    assert all(not core.verdicts.flags_of(p) for peers in stages.values() for p in peers)
    # Status still names what the step waits on.
    assert core.holdups.waiting is not None and core.holdups.waiting.stage == three


def test_disagreeing_reports_start_no_clock() -> None:
    # A liar's odd hash among the reporters: the stage's reporters do not hold one result, so the
    # replica that has not reported yet is nobody's holdout (the disagreement is the barrier's to judge).
    core = make_core()
    stages, three, step = _five_with_a_stage_of_three(core)
    _report(core, step, [p for s, peers in stages.items() if s != three for p in peers], 0.3)
    a, b, c = stages[three]
    core.handle(a, cm.Averaged(step=step, revision=1, result_hash="1" * 64), 0.3)
    core.handle(b, cm.Averaged(step=step, revision=1, result_hash="2" * 64), 0.3)  # no majority yet: no refusal
    _wait(core, 0.3 + 3 * GRACE, 0.3)
    assert not core.verdicts.flags_of(c)


def test_a_replica_behind_is_not_waited_for_on_later_steps_and_its_hold_still_expels_it() -> None:
    core = make_core()
    (s0, hung), (s1, s1b) = _members(core, "abcd").values()
    _beat(core, 0.1)
    now = 0.2
    limit = STEP_SETTINGS.expel_after_strikes
    assert limit is not None
    steps = []
    while not core.verdicts.is_banned(hung) and now < 60:
        step = _close(core, s0, s1, now)
        steps.append(step)
        _report(core, step, (s0, s1, s1b), now)
        began = now
        while not core.ledger.committed(step) and now < began + 2 * GRACE:
            now = _wait(core, now + 0.25, now)
        assert core.ledger.committed(step), f"step {step} waited on the hung replica past its grace"
        if len(steps) > 1:
            assert now - began <= 0.5, "a replica behind since an earlier step is not waited for at all"
        now = _wait(core, now + 1.0, now)  # the swarm trains a while between steps
    assert core.verdicts.is_banned(hung), "its hold went on across steps, a strike per grace, to the ban"
    assert not any(core.verdicts.is_banned(p) or core.verdicts.flags_of(p) for p in (s0, s1, s1b))


def test_when_a_stages_only_participant_goes_silent_its_left_out_replica_may_redo_the_step() -> None:
    # Every stage-0 ticket went through s0, which then hung: its stage-mate, left out, can fetch the
    # result from nobody. Stage 1 holds its result; once s0 held the commit a grace, it no longer counts
    # as holding stage 0's part, so the left-out replica's redo of the whole step is granted (else it
    # would resync, find the same state, and the step would never commit).
    core = make_core()
    (s0, left_out), (s1, s1b) = _members(core, "abcd").values()
    _beat(core, 0.1)
    step = _close(core, s0, s1, 0.2)
    _report(core, step, (s1, s1b), 0.3)
    B = core.run.microbatches_per_step
    with pytest.raises(Refusal, match="redo_refused"):  # within the grace s0 may still finish its round
        core.handle(left_out, cm.Redo(step=step, revision=1, indices=list(range(B)), reason="fetch failed"), 0.4)
    now = _wait(core, 0.3 + GRACE + 0.5, 0.3)
    assert core.verdicts.flags_of(s0) == ["commit_hold:1"] and not core.verdicts.flags_of(left_out)
    granted = core.handle(left_out, cm.Redo(step=step, revision=1, indices=list(range(B)), reason="fetch failed"), now)
    assert granted.reopened and granted.indices == list(range(B))


def test_a_step_a_liar_keeps_reopening_restarts_the_holds_and_strikes_nobody_it_delays() -> None:
    """Costs go to their cause (issue 27, rule 5): a participant that keeps reopening the closed step with redos
    makes its stage-mates average it anew each time; the time that costs them is the reopener's. Before, a
    hold's clock ran across revisions, and two honest replicas of a stage were struck for a commit a liar
    kept reopening (adversary simulator, redo_storm, seed 9)."""
    core = make_core()
    stages = _members(core, "abcde")
    three = next(s for s, peers in stages.items() if len(peers) == 3)
    other = 1 - three
    liar = stages[three][0]
    _beat(core, 0.1)
    B = core.run.microbatches_per_step
    step = core.ledger.step

    def close(now: float) -> None:  # every replica of the stage of three is a participant
        while core.ledger.step == step:
            for k, holder in enumerate(stages[0]):
                for i in core.handle(holder, cm.Lease(max_tickets=1), now).indices:
                    route = [holder, stages[1][k % len(stages[1])] if three == 0 else stages[1][i % 3]]
                    core.handle(holder, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=route, loss=1.0), now)

    close(0.2)
    revision = 1
    now = 0.2
    for _ in range(3):  # the honest replicas average each closing for most of a grace; the liar reopens before they report
        for p in stages[other]:
            core.handle(p, cm.Averaged(step=step, revision=revision), now)
        now = _wait(core, now + 0.8 * GRACE, now)
        assert core.handle(liar, cm.Redo(step=step, indices=[0], reason="round failed", revision=revision), now).reopened
        close(now)
        revision += 1
    assert now > 2 * GRACE, "the step was held past two graces in all"
    honest = [p for peers in stages.values() for p in peers if p != liar]
    assert not any(core.verdicts.flags_of(p) for p in honest), {p: core.verdicts.flags_of(p) for p in honest}
    # A real holdout is still struck, one grace after the last closing.
    hung = stages[three][2]
    for p in [p for peers in stages.values() for p in peers if p != hung]:
        core.handle(p, cm.Averaged(step=step, revision=revision), now)
    now = _wait(core, now + GRACE + 0.5, now)
    assert core.verdicts.flags_of(hung) == ["commit_hold:1"]
    assert core.ledger.committed(step)


def test_a_participant_that_departs_while_the_step_waits_restarts_its_stage_mates_holds() -> None:
    """Costs go to their cause: a participant that leaves (here: leaves and rejoins at once, a new membership)
    while its stage averages leaves the others' round waiting until they hold it out; that wait is its own, so
    their holds restart (adversary simulator, random strategy, seed 1269: two honest stage-1 replicas struck)."""
    core = make_core()
    stages = _members(core, "abcde")
    three = next(s for s, peers in stages.items() if len(peers) == 3)
    other = 1 - three
    leaver, a, b = stages[three]
    _beat(core, 0.1)
    B = core.run.microbatches_per_step
    step = core.ledger.step
    while core.ledger.step == step:  # every replica of the stage of three is a participant
        for k, holder in enumerate(stages[0]):
            for i in core.handle(holder, cm.Lease(max_tickets=1), 0.2).indices:
                route = [holder, stages[1][k % len(stages[1])] if three == 0 else stages[1][i % 3]]
                core.handle(holder, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=route, loss=1.0), 0.2)
    _report(core, step, stages[other], 0.3)
    now = _wait(core, 0.3 + 0.8 * GRACE, 0.3)
    core.handle(leaver, cm.Leave(reason="gone mid-round"), now)
    join(core, leaver, now)  # at once again: still a departure
    now = _wait(core, now + 0.8 * GRACE, now)
    assert now > 0.3 + GRACE and not core.verdicts.flags_of(a) and not core.verdicts.flags_of(b), "their wait was the leaver's"
