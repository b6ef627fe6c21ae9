"""The node's DiLoCo decisions, one transition at a time: the inner-step core (node/core/inner_step.py)
and one outer round (node/core/outer_round.py)."""

from __future__ import annotations

from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from protolearn.node.core import outer_round as orc
from protolearn.node.core.inner_step import INNER_RESULT, InnerStepCore, outer_boundary, outer_round_id
from protolearn.protocol.rounds import MAX_OUTER_ATTEMPTS
from protolearn.protocol.rounds import round_id
from protolearn.protocol.states import NodeState

CONFIG = nc.CoreConfig(microbatches_per_step=4, max_in_flight=4, max_deferred=4, averaging_timeout_s=10.0)
ACCOUNT = {"me": [0, 1], "mate": [2, 3]}
H = 4


def make(applied: int = 0, steps: int = 10) -> InnerStepCore:
    core = InnerStepCore("me", 1, CONFIG, inner_steps=H, steps=steps)
    core.handle(ev.Synced(applied), 0.0)
    return core


def kinds(actions: list) -> list[type]:
    return [type(a) for a in actions if not isinstance(a, ev.Emit)]


def finish_inner_step(core: InnerStepCore, step: int, account: dict[str, list[int]] = ACCOUNT, held: list[int] | None = None) -> list:
    """Close ``step`` and carry it to the commit; returns what the core does once it is applied."""
    (wait,) = [a for a in core.handle(ev.Closed(step, 1, account, 2.0, held=held if held is not None else account.get("me", [])), 0.0)
               if not isinstance(a, ev.Emit)]
    assert isinstance(wait, ev.WaitCommit) and wait.report
    (apply,) = core.handle(ev.CommitAnswer(step, 1, True), 0.1)
    assert isinstance(apply, ev.Apply) and apply.tickets == account.get("me", [])
    return core.handle(ev.Applied(step, "h"), 0.2)


def test_an_inner_step_needs_no_collective_and_applies_only_this_replicas_tickets() -> None:
    core = make()
    assert core.next_round == outer_round_id(H - 1)  # the window: the coming outer round's id
    assert kinds(finish_inner_step(core, 0)) == []
    assert core.applied == 1 and core.state is NodeState.TRAINING


def test_a_replica_the_accounting_left_out_reports_at_once_and_applies_no_ticket() -> None:
    core = make()
    assert finish_inner_step(core, 0, {"mate": [0, 1, 2, 3]}) == []
    assert core.applied == 1


def test_the_last_inner_step_of_a_round_syncs_before_it_counts_applied() -> None:
    core = make(applied=H - 1)
    (sync,) = finish_inner_step(core, H - 1)
    assert isinstance(sync, ev.SyncOuter) and (sync.step, sync.round) == (H - 1, 1)
    assert core.applied == H - 1 and core.phase is nc.Phase.OUTER  # work of step H stays held meanwhile
    core.outer_attempt = 2
    assert core.next_round == round_id(H - 1, 2)
    assert core.handle(ev.OuterDone(H - 1, "anchor"), 1.0) == []
    assert core.applied == H and core.outer_attempt == 1 and core.next_round == outer_round_id(2 * H - 1)


def test_a_replica_left_out_of_the_outer_round_resyncs() -> None:
    core = make(applied=H - 1)
    finish_inner_step(core, H - 1)
    actions = core.handle(ev.OuterDone(H - 1, resync=True, reason="late"), 1.0)
    assert kinds(actions) == [ev.Resync] and core.state is NodeState.SYNCING


def test_the_runs_last_step_ends_on_an_outer_sync() -> None:
    core = make(applied=9, steps=10)
    (sync,) = finish_inner_step(core, 9)
    assert isinstance(sync, ev.SyncOuter) and sync.round == 3 and outer_boundary(3, H, 10) == 9


def test_missing_tickets_are_redone_and_a_step_committed_without_this_replica_is_skipped() -> None:
    core = make()
    (ask,) = [a for a in core.handle(ev.Closed(0, 1, ACCOUNT, 2.0, held=[0]), 0.0) if not isinstance(a, ev.Emit)]
    assert isinstance(ask, ev.AskReported)
    # Another replica's state is no substitute between syncs: whatever it reports, the tickets are redone.
    (redo,) = [a for a in core.handle(ev.Reported(0, applied_elsewhere=True), 0.1) if not isinstance(a, ev.Emit)]
    assert isinstance(redo, ev.Redo) and redo.tickets == [1]
    (skip,) = [a for a in core.handle(ev.RedoAnswer(0, 1, granted=False, code="step_committed"), 0.2) if not isinstance(a, ev.Emit)]
    assert isinstance(skip, ev.Skip)
    assert core.handle(ev.Applied(0, "h"), 0.3) == [] and core.applied == 1


def test_the_inner_result_is_one_fixed_hash() -> None:
    assert INNER_RESULT == "inner"


# -- one outer round ---------------------------------------------------------------------------
def oc() -> orc.OuterRoundCore:
    return orc.OuterRoundCore("me", 1, 2, 2 * H - 1, ask_timeout_s=5.0)


def test_a_participant_averages_with_the_decided_weights_and_divides_by_the_kept_contributors() -> None:
    c = oc()
    assert c.start(0.0) == [orc.AskReady(2, 1)]
    assert c.handle(orc.Decided("pending", "waiting"), 1.0) == [orc.AskReady(2, 1)]
    (avg,) = c.handle(orc.Decided("participant", "go", {"me": 3.0, "mate": 1.0, "dead": 4.0}), 2.0)
    assert avg == orc.AverageOuter(round_id(2 * H - 1, 1), {"me": 3.0, "mate": 1.0, "dead": 4.0})
    actions = c.handle(orc.Averaged(("mate", "me")), 3.0)
    assert actions[-1] == orc.ApplyOuter() and any(isinstance(a, ev.Emit) and a.event == "outer_replica_out" for a in actions)
    assert orc.total_weight(c.weights, ("mate", "me")) == 4.0
    assert c.handle(orc.Installed("new"), 3.5) == [orc.Finish(param_hash="new")]


def test_a_follower_fetches_and_one_left_out_resyncs() -> None:
    c = oc()
    c.start(0.0)
    (fetch,) = c.handle(orc.Decided("follower", "go", {"a": 1.0, "b": 2.0}, ("me",)), 1.0)
    assert fetch == orc.FetchOuter(round_id(2 * H - 1, 1), {"a": 1.0, "b": 2.0})
    assert c.handle(orc.Fetched(True), 2.0) == [orc.ApplyOuter()]
    c2 = oc()
    c2.start(0.0)
    (fin,) = c2.handle(orc.Fetched(False, "gone"), 1.0)
    assert fin.resync
    c3 = oc()
    c3.start(0.0)
    (fin,) = c3.handle(orc.Decided("left_out", "late"), 1.0)
    assert fin == orc.Finish(resync=True, reason="late")


def test_a_failed_collective_takes_a_participant_that_finished_else_retries_until_the_cap() -> None:
    c = oc()
    c.start(0.0)
    c.handle(orc.Decided("participant", "go", {"me": 1.0, "b": 1.0, "c": 1.0}), 1.0)
    # Others may have finished with this replica's part in (its own round failed after): their proven result,
    # not a new average; the proof is over every participant's weight, this replica's too.
    (fetch,) = c.handle(orc.AverageFailed("left out"), 2.0)
    assert fetch == orc.FetchOuter(round_id(2 * H - 1, 1), {"me": 1.0, "b": 1.0, "c": 1.0}, orc.FETCH_AFTER_FAILURE_S)
    assert c.handle(orc.Fetched(True), 2.5) == [orc.ApplyOuter()]
    # Nobody finished: the next attempt.
    c2 = oc()
    c2.start(0.0)
    c2.handle(orc.Decided("participant", "go", {"me": 1.0, "b": 1.0}), 1.0)
    c2.handle(orc.AverageFailed("vetoed"), 2.0)
    actions = c2.handle(orc.Fetched(False, "refused"), 3.0)
    assert actions[-1] == orc.AskReady(2, 2) and c2.round_id == round_id(2 * H - 1, 2)
    c2.attempt = MAX_OUTER_ATTEMPTS
    c2.handle(orc.Decided("participant", "go", {"me": 1.0, "b": 1.0}), 4.0)
    c2.handle(orc.AverageFailed("vetoed"), 5.0)
    (fin,) = c2.handle(orc.Fetched(False, "refused"), 6.0)
    assert fin.resync


def test_a_round_that_kept_only_a_minority_of_its_participants_is_not_applied_but_attempted_again() -> None:
    # The others were left out here while they still worked (late, not dead): they cannot take this replica's
    # result (a strict majority of fins proves a fetched one), so applying it would split the stage.
    c = oc()
    c.start(0.0)
    c.handle(orc.Decided("participant", "go", {"me": 1.0, "b": 1.0, "c": 1.0}), 1.0)
    actions = c.handle(orc.Averaged(("me",)), 2.0)
    assert orc.ApplyOuter() not in actions and actions[-1] == orc.AskReady(2, 2)
    # Two of three is a majority: applied (the third resyncs to it).
    c2 = oc()
    c2.start(0.0)
    c2.handle(orc.Decided("participant", "go", {"me": 1.0, "b": 1.0, "c": 1.0}), 1.0)
    assert c2.handle(orc.Averaged(("b", "me")), 2.0)[-1] == orc.ApplyOuter()


def test_a_silent_coordinator_is_asked_again_then_the_replica_resyncs() -> None:
    c = oc()
    c.start(0.0)
    assert c.handle(orc.Unanswered("down"), 1.0) == [orc.AskReady(2, 1, orc.ASK_AGAIN_S)]
    (fin,) = c.handle(orc.Unanswered("down"), 6.0)
    assert fin.resync and "did not decide" in fin.reason
