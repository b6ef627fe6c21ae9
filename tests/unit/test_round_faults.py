"""Costs of a failed collective round go to their cause (coordinator/core/round_faults.py; issue 27, rule 5).

The stage takeover of issue 27: one liar among three replicas fails the two honest replicas' rounds, each
failure makes them ask for a redo, and the redos were charged to them until they were refused, resynced,
and left the liar alone in its stage's commit. Now the honest replicas name the liar as their round's
cause, a strict majority of the stage's participants corroborates it, their redos cost them nothing, the
liar takes a ``round_fault`` strike per round and sits out the rest of the step, and a few rounds ban it.
"""

from __future__ import annotations

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.round_faults import RoundFaults
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from tests.support.coordinator import STEP_SETTINGS, TEST_ACK, join
from tests.support.coordinator import default_core as make_core


def _faults(**settings: object) -> tuple[RoundFaults, VerdictPolicy, list[str]]:
    s = CoordinatorSettings(**settings)  # type: ignore[arg-type]
    v = VerdictPolicy(s)
    banned: list[str] = []
    return RoundFaults(s, v, ban=lambda p, why, now: banned.append(p)), v, banned


def test_a_cause_named_by_a_strict_majority_of_the_participants_is_struck_and_its_namers_refunded() -> None:
    rf, v, _ = _faults()
    first = rf.name("a", step=3, revision=1, stage=1, causes=["liar"], participants=["a", "b", "liar"], now=1.0)
    assert not first.corroborated and first.refund == (), "one of three is a word against a word: the sender pays for now"
    second = rf.name("b", step=3, revision=1, stage=1, causes=["liar"], participants=["a", "b", "liar"], now=1.1)
    assert second.corroborated == {"liar"} and second.refund == ("a",), "two of three: free for both, in hindsight for a"
    assert v.flags_of("liar") == ["round_fault:1"] and not v.flags_of("a") and not v.flags_of("b")
    # The liar names an honest replica back: a minority's word, which corroborates nothing.
    back = rf.name("liar", step=3, revision=1, stage=1, causes=["a"], participants=["a", "b", "liar"], now=1.2)
    assert not back.corroborated and not v.flags_of("a")
    assert rf.barred(3, lambda p: 1, lambda s: ["a", "b", "liar"], 1) == {"liar"}


def test_namers_and_causes_outside_the_participants_count_for_nothing() -> None:
    rf, v, _ = _faults()
    participants = ["a", "b", "c"]
    for sybil in ("s1", "s2", "s3"):  # not participants of the round: their word is no one's
        rf.name(sybil, step=0, revision=1, stage=0, causes=["a"], participants=participants, now=1.0)
    assert not v.flags_of("a")
    named = rf.name("a", step=0, revision=1, stage=0, causes=["a", "outsider"], participants=participants, now=1.0)
    assert not named.corroborated, "nobody names itself, and an outsider took no part in the round"


def test_in_a_round_of_two_the_cause_is_unknown_nobody_pays_and_the_named_one_sits_out_the_step() -> None:
    rf, v, _ = _faults()
    named = rf.name("honest", step=5, revision=2, stage=0, causes=["liar"], participants=["honest", "liar"], now=1.0)
    assert named.corroborated == {"liar"}, "free for the sender: the cause cannot be known in a round of two"
    assert not v.flags_of("liar"), "and nobody is struck"
    assert rf.barred(5, lambda p: 0, lambda s: ["honest", "liar", "left_out"], 0) == {"liar"}
    # Sitting out never empties a stage.
    assert rf.barred(5, lambda p: 0, lambda s: ["liar"], 0) == set()
    # The bar lasts for its step only.
    rf.name("x", step=6, revision=1, stage=0, causes=[], participants=["x", "y"], now=2.0)
    assert rf.barred(5, lambda p: 0, lambda s: ["honest", "liar"], 0) == set()


def test_expel_after_strikes_corroborated_faults_within_the_window_ban_the_cause() -> None:
    rf, v, banned = _faults(expel_after_strikes=3, report_window_s=100.0)
    p = ["a", "b", "liar"]
    for k in range(3):
        for sender in ("a", "b"):
            rf.name(sender, step=k, revision=1, stage=0, causes=["liar"], participants=p, now=10.0 * k)
    assert banned == ["liar"]
    rf2, _, banned2 = _faults(expel_after_strikes=3, report_window_s=15.0)
    for k in range(3):  # 20 s apart: never three within the window
        for sender in ("a", "b"):
            rf2.name(sender, step=k, revision=1, stage=0, causes=["liar"], participants=p, now=20.0 * k)
    assert banned2 == []


def _stage_of_three(core: CoordinatorCore) -> tuple[list[str], list[str]]:
    stages: dict[int, list[str]] = {}
    for p in "abcdef":
        stages.setdefault(join(core, p).stage, []).append(p)
    for m in list(core.registry.live()):
        core.handle(m.peer_id, cm.Heartbeat(state="training", stage=m.stage), 0.1)
    return stages[0], stages[1]


def _close_through(core: CoordinatorCore, s0: list[str], s1: list[str], now: float) -> int:
    """Close the open step with every stage-0 replica leasing and each ticket routed to a stage-1 replica in turn."""
    step = core.ledger.step
    k = 0
    while core.ledger.step == step:
        progressed = False
        for holder in s0:
            lease = core.handle(holder, cm.Lease(max_tickets=1), now)
            for i in lease.indices:
                route = [holder, s1[k % len(s1)]]
                k += 1
                core.handle(holder, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=route, loss=1.0), now)
                progressed = True
        assert progressed, "nobody could lease"
    return step


def test_a_liar_that_fails_its_stages_rounds_cannot_drain_the_honest_replicas_budgets_and_is_banned() -> None:
    """Issue 27's stage takeover at the coordinator: the liar of stage 1 fails its stage's round in every step;
    the two honest replicas name it each time. Before, their redos were charged to them: the 9th of a step was
    refused (``redo_limit``), and the honest replica resynced, leaving the liar alone in its stage's commit."""
    core = make_core()
    s0, s1 = _stage_of_three(core)
    liar, a, b = s1
    B = core.run.microbatches_per_step
    now = 0.2
    steps = 0
    while not core.verdicts.is_banned(liar):
        steps += 1
        assert steps <= 10, "the liar is banned after a bounded number of failed rounds"
        step = _close_through(core, s0, s1, now)  # all three replicas of stage 1 take part
        revision = core.ledger.closed[step].revision
        for honest in (a, b):  # their round failed, with the liar's statement as its cause
            reply = core.handle(honest, cm.Redo(step=step, indices=list(range(B)), revision=revision, kind="round_failed",
                                                causes=[liar], reason="a fin without me"), now)
            assert isinstance(reply, cm.RedoReply)
        try:  # the liar asks too, blaming an honest replica: a minority's word
            core.handle(liar, cm.Redo(step=step, indices=[0], revision=revision, kind="round_failed", causes=[a], reason="lies"), now)
        except Refusal:
            pass
        if core.verdicts.is_banned(liar):
            break
        # It sits out the redo: stage 0 is told to route no ticket of the step through it, and the redo runs
        # among the honest replicas, whose round succeeds.
        lease = core.handle(s0[0], cm.Lease(max_tickets=1), now)
        assert lease.avoid == [liar]
        for i in lease.indices:
            core.handle(s0[0], cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0[0], a], loss=1.0), now)
        _close_through(core, s0, [a, b], now)
        revision = core.ledger.closed[step].revision
        for p in s0 + [a, b]:
            core.handle(p, cm.Averaged(step=step, revision=revision), now)
        try:  # it claims a made-up result of the round it sat out: outvoted
            core.handle(liar, cm.Averaged(step=step, revision=revision, result_hash="f" * 64), now)
        except Refusal as err:
            assert err.code == "result_mismatch"
        assert core.ledger.committed(step) and core.ledger.barrier.hashes[1] == ""
        now += 5.0
    assert steps == STEP_SETTINGS.expel_after_strikes
    for honest in (a, b):
        assert not core.verdicts.flags_of(honest), core.verdicts.flags_of(honest)
    assert core.verdicts.bans[liar].reason.startswith("liveness: a strict majority of stage 1's participants named it")
