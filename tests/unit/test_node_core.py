"""The node core's decisions, one transition at a time, and its purity (no trio, libp2p, sockets or torch)."""

from __future__ import annotations


import pytest

from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from protolearn.node.core import leasing as lc
from protolearn.protocol.states import NodeState

CONFIG = nc.CoreConfig(microbatches_per_step=4, max_in_flight=4, max_deferred=4, averaging_timeout_s=10.0)
ACCOUNT = {"me": [0, 1], "mate": [2, 3]}


def make(applied: int = 0, me: str = "me") -> nc.NodeCore:
    core = nc.NodeCore(me, 1, CONFIG)
    core.handle(ev.Synced(applied), 0.0)
    return core


def only(actions: list[ev.Action], kind: type) -> list:
    """The actions of ``kind``, after checking every other action is a log event."""
    assert all(isinstance(a, (kind, ev.Emit)) for a in actions), actions
    return [a for a in actions if isinstance(a, kind)]


def emitted(actions: list[ev.Action]) -> list[str]:
    return [a.event for a in actions if isinstance(a, ev.Emit)]


def test_a_participant_averages_its_accounted_tickets_waits_for_the_commit_and_applies() -> None:
    core = make()
    assert core.state is NodeState.TRAINING and core.applied == 0 and core.next_round == nc.round_id(0)
    (avg,) = only(core.handle(ev.Closed(0, 1, ACCOUNT, 2.5, held=[0, 1]), 1.0), ev.Average)
    assert avg.tickets == [0, 1] and avg.weights == {"me": 2.0, "mate": 2.0} and avg.round == nc.round_id(0, 1)
    assert core.state is NodeState.AVERAGING
    (wait,) = only(core.handle(ev.RoundDone(0, 1, []), 1.5), ev.WaitCommit)
    assert wait.report and core.next_round == nc.round_id(0, 2)  # it may still reopen
    (apply,) = only(core.handle(ev.CommitAnswer(0, 1, True), 2.0), ev.Apply)
    assert apply.counted == [0, 1, 2, 3] and apply.loss == 2.5
    assert core.handle(ev.Applied(0, "h"), 2.1) == []
    assert core.applied == 1 and core.state is NodeState.TRAINING and core.next_round == nc.round_id(1)


def test_a_close_that_names_its_tickets_counts_those_and_one_that_does_not_works_them_out() -> None:
    # The simulator hands every replica of a stage the one sorted list of its tickets (events.Closed.tickets).
    for given in (None, [0, 1, 3, 5]):
        core = make()
        core.handle(ev.Closed(0, 1, {"mate": [3, 5], "me": [0, 1]}, None, held=[0, 1], tickets=given), 0.0)
        core.handle(ev.RoundDone(0, 1, []), 1.0)
        (apply,) = only(core.handle(ev.CommitAnswer(0, 1, True), 2.0), ev.Apply)
        assert apply.counted == [0, 1, 3, 5] and core.all_tickets() == [0, 1, 3, 5]
        assert core.all_tickets() is not core.all_tickets()  # a caller's list, never the core's own


def test_gradients_held_but_not_accounted_are_left_out_and_said() -> None:
    core = make()
    actions = core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1, 2]), 0.0)
    assert only(actions, ev.Average)[0].tickets == [0, 1]
    assert emitted(actions) == ["tickets_not_counted"]


def test_a_dead_mate_is_redone_and_the_step_waits_for_the_next_revision() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    (redo,) = only(core.handle(ev.RoundDone(0, 1, ["mate"]), 1.0), ev.Redo)
    assert redo.tickets == [2, 3] and redo.revision == 1
    (wait,) = only(core.handle(ev.RedoAnswer(0, 1, granted=True), 1.1), ev.WaitClosed)
    assert (wait.step, wait.revision) == (0, 2) and core.applied == 0
    # The step closes again at revision 2: it is averaged in a fresh round.
    (avg,) = only(core.handle(ev.Closed(0, 2, {"me": [0, 1, 2, 3]}, None, held=[0, 1, 2, 3]), 2.0), ev.Average)
    assert avg.round == nc.round_id(0, 2) and avg.tickets == [0, 1, 2, 3]


def test_a_refused_redo_of_a_dead_mates_tickets_is_applied_only_with_a_loud_tickets_lost() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    core.handle(ev.RoundDone(0, 1, ["mate"]), 1.0)
    only(core.handle(ev.RedoAnswer(0, 1, granted=False, reason="no"), 1.1), ev.AskReopened)
    actions = core.handle(ev.ReopenAnswer(0, 1, reopened=False), 1.2)
    assert "tickets_lost" in emitted(actions) and only(actions, ev.WaitCommit)
    # Another replica reopened the step first: the same answer path waits for the next revision.
    core2 = make()
    core2.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    core2.handle(ev.RoundDone(0, 1, ["mate"]), 1.0)
    core2.handle(ev.RedoAnswer(0, 1, granted=False), 1.1)
    assert only(core2.handle(ev.ReopenAnswer(0, 1, reopened=True), 1.2), ev.WaitClosed)


def test_an_unanswered_redo_is_asked_again_never_taken_as_a_refusal() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    (first,) = only(core.handle(ev.RoundDone(0, 1, ["mate"]), 1.0), ev.Redo)
    (again,) = only(core.handle(ev.RedoAnswer(0, 1, granted=None, reason="restarting"), 1.1), ev.Redo)
    assert again.tickets == first.tickets and again.delay_s == nc.ASK_AGAIN_S
    # Past the averaging timeout it gives up safely: a resync, never an apply of a partial sum.
    assert only(core.handle(ev.RedoAnswer(0, 1, granted=None, reason="restarting"), 11.0), ev.Resync)
    assert core.state is NodeState.SYNCING


def test_an_unanswered_reopen_question_is_asked_again_then_resyncs() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    core.handle(ev.RoundFailed(0, 1, "two replicas died"), 1.0)
    core.handle(ev.Fetched(0, 1, ok=False, reason="the round failed at every other participant"), 1.05)
    core.handle(ev.RedoAnswer(0, 1, granted=False), 1.1)
    (ask,) = only(core.handle(ev.ReopenAnswer(0, 1, reopened=None, reason="timeout"), 1.2), ev.AskReopened)
    assert ask.delay_s == nc.ASK_AGAIN_S
    assert only(core.handle(ev.ReopenAnswer(0, 1, reopened=None, reason="timeout"), 10.5), ev.Resync)


def test_a_failed_round_redoes_the_whole_step_naming_its_causes_or_resyncs_if_refused() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    actions = core.handle(ev.RoundFailed(0, 1, "mate signed a fin without me", ("mate",)), 1.0)
    assert emitted(actions) == ["averaging_failed"]
    (fetch,) = only(actions, ev.Fetch)  # first: did the others finish the round?
    assert fetch.weights == {"me": 2.0, "mate": 2.0}
    (redo,) = only(core.handle(ev.Fetched(0, 1, ok=False, reason="the round failed at every other participant"), 1.1), ev.Redo)
    assert redo.tickets == [0, 1, 2, 3] and redo.kind == "round_failed" and redo.causes == ("mate",)
    core.handle(ev.RedoAnswer(0, 1, granted=False), 1.2)
    assert only(core.handle(ev.ReopenAnswer(0, 1, reopened=False), 1.3), ev.Resync)


def test_a_replica_whose_round_failed_takes_the_others_proven_result_and_redoes_nothing() -> None:
    """A liar that fails only this replica's round (a fin without it) while the others finish gains nothing:
    this replica takes their full average (proven by a majority of fins, result_proof.py) and reports it."""
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, 2.5, held=[0, 1]), 0.0)
    core.handle(ev.RoundFailed(0, 1, "mate signed a fin without me", ("mate",)), 1.0)
    actions = core.handle(ev.Fetched(0, 1, ok=True), 1.1)
    assert emitted(actions) == ["result_taken"] and not [a for a in actions if isinstance(a, ev.Redo)]
    (wait,) = [a for a in actions if isinstance(a, ev.WaitCommit)]
    assert wait.report
    (apply,) = only(core.handle(ev.CommitAnswer(0, 1, True), 1.2), ev.Apply)
    assert apply.counted == [0, 1, 2, 3], "the others' full average has every ticket in"


def test_lost_gradients_resync_when_a_replica_applied_else_are_redone() -> None:
    core = make()
    assert only(core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[]), 0.0), ev.AskReported)
    assert only(core.handle(ev.Reported(0, applied_elsewhere=True), 0.1), ev.Resync)
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[1]), 0.0)
    actions = core.handle(ev.Reported(0, applied_elsewhere=False), 0.1)
    assert "missing_tickets" in emitted(actions) and only(actions, ev.Redo)[0].tickets == [0]


def test_a_left_out_replica_fetches_reports_and_applies() -> None:
    core = make(me="idle")
    (fetch,) = only(core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[]), 0.0), ev.Fetch)
    assert sorted(fetch.weights) == ["mate", "me"] and fetch.round == nc.round_id(0, 1)
    (wait,) = only(core.handle(ev.Fetched(0, 1, ok=True), 0.5), ev.WaitCommit)
    assert wait.report, "a replica that holds the result says so: the commit waits for it"
    assert only(core.handle(ev.CommitAnswer(0, 1, True), 0.6), ev.Apply)[0].counted is None


def test_a_left_out_replica_without_a_result_asks_reopen_then_redo_then_fetches_again_until_its_deadline() -> None:
    core = make(me="idle")
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[]), 0.0)
    only(core.handle(ev.Fetched(0, 1, ok=False, reason="timeout"), 3.0), ev.AskReopened)
    (redo,) = only(core.handle(ev.ReopenAnswer(0, 1, reopened=False), 3.1), ev.Redo)
    assert redo.expected and redo.tickets == [0, 1, 2, 3]  # granted only once every participant is gone
    core.handle(ev.RedoAnswer(0, 1, granted=False), 3.2)
    assert only(core.handle(ev.ReopenAnswer(0, 1, reopened=False), 3.3), ev.Fetch)
    core.handle(ev.Fetched(0, 1, ok=False), 9.0)
    core.handle(ev.ReopenAnswer(0, 1, reopened=False), 9.1)
    core.handle(ev.RedoAnswer(0, 1, granted=False), 9.2)
    assert only(core.handle(ev.ReopenAnswer(0, 1, reopened=False), 10.5), ev.Resync)
    # A participant that no longer keeps the round, and the step did not reopen (it committed): a resync.
    core = make(me="idle")
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[]), 0.0)
    only(core.handle(ev.Fetched(0, 1, ok=False, gone=True, reason="moved on"), 0.1), ev.AskReopened)
    assert only(core.handle(ev.ReopenAnswer(0, 1, reopened=False), 0.2), ev.Resync)


def test_a_left_out_replica_whose_participant_moved_on_to_a_reopened_revision_follows_the_step() -> None:
    """Abuse bench (long_poll_slots, 1 run in 4): a Sybil left during step 6, its tickets were redone twice, and the
    participant a left-out replica asked for revision 2's result was already at revision 4: the replica resynced,
    though the step was still open to it. It now waits for the step's next closing, like every replica."""
    core = make(me="idle")
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[]), 0.0)
    only(core.handle(ev.Fetched(0, 1, ok=False, gone=True, reason="round is not kept (next round 6)"), 0.1), ev.AskReopened)
    (wait,) = only(core.handle(ev.ReopenAnswer(0, 1, reopened=True), 0.2), ev.WaitClosed)
    assert wait.revision == 2
    (fetch,) = only(core.handle(ev.Closed(0, 3, ACCOUNT, None, held=[]), 0.3), ev.Fetch)  # it closed twice more meanwhile
    assert fetch.round == nc.round_id(0, 3)
    only(core.handle(ev.Fetched(0, 3, ok=True), 0.4), ev.WaitCommit)


def test_a_step_that_reopened_while_waiting_for_the_commit_is_finished_again() -> None:
    core = make()
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    core.handle(ev.RoundDone(0, 1, []), 0.5)
    actions = core.handle(ev.CommitAnswer(0, 1, False), 0.6)
    assert emitted(actions) == ["reopened"] and only(actions, ev.WaitClosed)[0].revision == 2


def test_work_held_for_the_next_step_starts_once_the_step_is_applied() -> None:
    core = make()
    assert core.accounting.admit_forward(1, 0, "payload").action == "defer"
    core.handle(ev.Closed(0, 1, ACCOUNT, None, held=[0, 1]), 0.0)
    core.handle(ev.RoundDone(0, 1, []), 0.1)
    core.handle(ev.CommitAnswer(0, 1, True), 0.2)
    assert core.handle(ev.Applied(0, "h"), 0.3) == [ev.StartHeld(["payload"])]


def test_stray_events_are_dropped_with_a_warning_and_a_revision_past_the_cap_resyncs() -> None:
    core = make(applied=3)
    actions = core.handle(ev.Closed(1, 1, ACCOUNT, None, held=[]), 0.0)
    assert emitted(actions) == ["ignored"] and actions[0].level  # logged, not silent
    assert emitted(core.handle(ev.RoundDone(7, 1, []), 0.0)) == ["ignored"]
    assert only(core.handle(ev.Closed(3, nc.REVISIONS_PER_STEP + 1, ACCOUNT, None, held=[0, 1]), 0.0), ev.Resync)
    with pytest.raises(RuntimeError):  # an answer to a question the core did not ask is an adapter bug
        make().handle(ev.CommitAnswer(-1, 1, True), 0.0)


# -- stage 0's leases ------------------------------------------------------------------------------
def lease_core(**kw) -> lc.LeaseCore:
    args = {"max_in_flight": 4, "lease_block": 2, "stall_s": 5.0, "last_stage": False} | kw
    core = lc.LeaseCore(**args)
    core.begin(0, [], 0.0)
    return core


def test_leases_start_tickets_up_to_the_room_one_request_at_a_time() -> None:
    core = lease_core()
    assert core.poll(0.0, in_flight=0, has_next_stage=True) == [lc.RequestLease(2)]
    assert core.poll(0.0, in_flight=0, has_next_stage=True) == []  # one request in flight
    assert core.handle(lc.Leased(0, [0, 1]), 0.1) == [lc.StartTicket(0, 0), lc.StartTicket(0, 1)]
    assert core.poll(0.1, in_flight=4, has_next_stage=True) == []  # no room
    assert core.poll(0.2, in_flight=3, has_next_stage=True) == [lc.RequestLease(1, holding=(0, 1))]


def test_a_replica_that_gets_no_ticket_for_a_while_logs_the_coordinators_reason_once() -> None:
    core = lease_core()
    why = "the run starts when 4 nodes have joined (2 so far)"
    told = []
    for k in range(30):  # empty answers a second apart for 30 s, some held by the coordinator; a ticket; empty again
        now = float(k)
        core.poll(now, in_flight=0, has_next_stage=True)
        told += [a for a in core.handle(lc.Leased(0, [], waited=k % 2 == 1, reason=why), now) if isinstance(a, lc.Emit)]
    assert [(e.event, e.fields["reason"], e.fields["for_s"]) for e in told] == [("lease_idle", why, lc.IDLE_TOLD_S)]
    core.poll(31.0, in_flight=0, has_next_stage=True)
    assert core.handle(lc.Leased(0, [0]), 31.0) == [lc.StartTicket(0, 0)]
    again = []
    for k in range(32, 32 + int(lc.IDLE_TOLD_S) + 1):
        core.poll(float(k), in_flight=0, has_next_stage=True)
        again += [a for a in core.handle(lc.Leased(0, [], reason="x"), float(k)) if isinstance(a, lc.Emit)]
    assert [e.fields["reason"] for e in again] == ["x"], "a new run of empty answers is told again"


def test_no_leases_while_stage_one_has_no_replica() -> None:
    core = lease_core()
    assert core.poll(0.0, in_flight=0, has_next_stage=False) == []
    assert lease_core(last_stage=True).poll(0.0, in_flight=0, has_next_stage=False) == [lc.RequestLease(2)]


def test_stalled_tickets_and_those_sent_to_a_dead_peer_restart() -> None:
    core = lease_core()
    core.poll(0.0, in_flight=0, has_next_stage=True)
    core.handle(lc.Leased(0, [0, 1, 2]), 0.0)
    for t in (0, 1, 2):
        core.handle(lc.Handed(0, t), 0.0)
    core.handle(lc.PeerDown("p", [1]), 1.0)
    assert only(core.poll(1.0, in_flight=4, has_next_stage=True), lc.StartTicket) == [lc.StartTicket(0, 1)]
    core.handle(lc.Handed(0, 1), 1.0)
    assert core.next_wake(4.5) == pytest.approx(5.0)  # when tickets 0 and 2 stall
    restarted = only(core.poll(5.5, in_flight=4, has_next_stage=True), lc.StartTicket)
    assert restarted == [lc.StartTicket(0, 0), lc.StartTicket(0, 2)]  # their gradient never came back
    for t in (0, 2):
        core.handle(lc.Handed(0, t), 5.5)
    core.handle(lc.MemberLeft(), 6.0)
    assert len(only(core.poll(6.0, in_flight=4, has_next_stage=True), lc.StartTicket)) == 3


def test_a_ticket_has_one_attempt_at_a_time_so_failed_sends_to_a_gone_peer_do_not_restart_it_in_a_loop() -> None:
    """Issue 28, stage 1's last replica hung and left: every forward to it failed, each failure reported the peer
    down with every ticket once handed to it, and each report restarted all of them again while their last
    attempts were still trying it; about 100 restarts a second, whose releases got the node banned by the
    coordinator. An attempt being started is never restarted: it ends handed on or not started."""
    core = lease_core()
    core.poll(0.0, in_flight=0, has_next_stage=True)
    core.handle(lc.Leased(0, [0, 1]), 0.0)
    for t in (0, 1):
        core.handle(lc.Handed(0, t), 0.0)
    core.handle(lc.PeerDown("gone", [0, 1]), 1.0)  # its connection closed: both restart once
    assert only(core.poll(1.0, in_flight=4, has_next_stage=True), lc.StartTicket) == [lc.StartTicket(0, 0), lc.StartTicket(0, 1)]
    for k in range(20):  # the restarted attempts' own sends to it fail, again and again, while they run
        core.handle(lc.PeerDown("gone", [0, 1]), 1.0 + k * 0.01)
        core.handle(lc.MemberLeft(), 1.0 + k * 0.01)
        assert only(core.poll(1.0 + k * 0.01, in_flight=4, has_next_stage=True), lc.StartTicket) == []
    assert core.next_wake(1.2) > 1.2  # and no busy loop: nothing handed can stall yet
    # The attempts end not started: released once each, and leasing pauses.
    assert core.handle(lc.NotStarted(0, 0), 1.3) == [lc.Release(0, [0])]
    assert core.handle(lc.NotStarted(0, 1), 1.3) == [lc.Release(0, [1])]
    assert core.started == {}
    # A restarted attempt that is handed on can be restarted again when its peer goes.
    core.handle(lc.Leased(0, [0]), 2.0)
    core.handle(lc.Handed(0, 0), 2.0)
    core.handle(lc.PeerDown("other", [0]), 2.5)
    assert only(core.poll(2.5, in_flight=4, has_next_stage=True), lc.StartTicket) == [lc.StartTicket(0, 0)]


def test_tickets_no_next_stage_peer_takes_pause_leasing_longer_each_time_until_one_completes() -> None:
    """Issue 28: with stage 1's only replica gone (its view entry not yet expired), each leased ticket failed
    to start, was released and leased again at once: hundreds of coordinator requests a second per node,
    until the coordinator banned them for it. Now leasing pauses, doubling per failed start up to 2 s."""
    core = lease_core()
    now, pauses = 0.0, []
    for ticket in range(8):
        core.handle(lc.Leased(0, [ticket]), now)
        assert core.handle(lc.NotStarted(0, ticket), now) == [lc.Release(0, [ticket])]
        failed_at = now
        while not core.poll(now, in_flight=0, has_next_stage=True):  # no lease during the pause
            now = core.next_wake(now)
        pauses.append(round(now - failed_at, 3))
    assert pauses == [round(lc.LEASE_RETRY_S * 2**k, 3) for k in range(6)] + [lc.NOT_STARTED_MAX_S] * 2
    # A ticket that completes shows the pipeline works again: the next failed start pauses briefly.
    core.poll(now, in_flight=0, has_next_stage=True)
    core.handle(lc.Leased(0, [0]), now)
    core.handle(lc.Completed(0, 0, ["a", "b"], 2.0), now)
    core.handle(lc.NotStarted(0, 1), now)
    assert core.next_wake(now) - now == pytest.approx(lc.LEASE_RETRY_S)


def test_empty_lease_answers_back_off_until_a_ticket_comes() -> None:
    """Issue 26: a step whose tickets are all out answers every lease empty; at a fixed 50 ms each stage-0 replica
    asked 20 times a second for the whole step (6,000 requests a second from the 312 stage-0 replicas of a
    10,000-node swarm, in the simulator). Now it backs off, doubling up to EMPTY_LEASE_MAX_S; a lease that
    brings a ticket resets it."""
    core = lease_core()
    now, asked, pauses = 0.0, [], []
    while len(asked) < 9:
        if only(core.poll(now, in_flight=0, has_next_stage=True), lc.RequestLease):
            asked.append(now)
            core.handle(lc.Leased(0, []), now)
        now = core.next_wake(now)
    pauses = [round(b - a, 3) for a, b in zip(asked, asked[1:])]
    assert pauses == [min(lc.EMPTY_LEASE_MAX_S, round(lc.LEASE_RETRY_S * 2**k, 3)) for k in range(8)]
    while not only(core.poll(now, in_flight=0, has_next_stage=True), lc.RequestLease):
        now = core.next_wake(now)
    core.handle(lc.Leased(0, [3]), now)  # a ticket came back (a redo): the next empty answer pauses briefly again
    core.poll(now, in_flight=1, has_next_stage=True)
    core.handle(lc.Leased(0, []), now)
    assert core.next_wake(now) - now == pytest.approx(lc.LEASE_RETRY_S)


def test_a_lease_asks_the_coordinator_to_wait_and_an_empty_answer_after_a_wait_is_asked_again_at_once() -> None:
    """Issue 28: a stage-0 replica killed mid-step held tickets; the coordinator ended its leases 0.5 s after its
    connection closed, and the surviving replica, deep in its back-off, took them 0.49 s later still. A lease now
    asks the coordinator to hold it until a ticket frees, so the back-off applies only to answers it did not hold."""
    core = lease_core()
    now = 0.0
    for _ in range(6):  # empty answers the coordinator held: no back-off builds up
        (ask,) = only(core.poll(now, in_flight=0, has_next_stage=True), lc.RequestLease)
        assert ask.wait_s == lc.LEASE_WAIT_S > 0
        now += lc.LEASE_WAIT_S
        core.handle(lc.Leased(0, [], waited=True), now)
        assert core.next_wake(now) - now == pytest.approx(lc.LEASE_RETRY_S)
        now = core.next_wake(now)
    for k in range(3):  # answered at once (no slot to wait in): the back-off as before
        while not only(core.poll(now, in_flight=0, has_next_stage=True), lc.RequestLease):
            now = core.next_wake(now)
        core.handle(lc.Leased(0, []), now)
        assert core.next_wake(now) - now == pytest.approx(lc.LEASE_RETRY_S * 2**k)


def test_tickets_leased_in_an_answer_the_node_never_read_are_started_when_the_next_answer_names_them() -> None:
    """Issue 28 (bench.py recovery): a restarted replica's lease request, held by the coordinator, was answered with
    two tickets just as the node gave the request up (the step it drove had committed). The coordinator counted them
    as the node's; the node, holding nothing, was told "already holds its share; finish those first" for 10 s, until
    the coordinator struck it, and the step waited. A lease now lists what the node works on, and the answer names
    what else the coordinator has it holding."""
    core = lease_core()
    (ask,) = only(core.poll(0.0, in_flight=0, has_next_stage=True), lc.RequestLease)
    assert ask.holding == ()
    core.begin(0, [], 0.1)  # the answer to that request was never read
    (ask,) = only(core.poll(0.1, in_flight=0, has_next_stage=True), lc.RequestLease)
    assert ask.holding == ()
    out = core.handle(lc.Leased(0, [], held=(0, 1)), 0.2)
    assert emitted(out) == ["lease_recovered"]
    assert only(out, lc.StartTicket) == [lc.StartTicket(0, 0), lc.StartTicket(0, 1)]
    # It now lists them; one it works on that an answer names again (a crossing request) is not started twice.
    (ask,) = only(core.poll(0.2 + lc.LEASE_RETRY_S, in_flight=2, has_next_stage=True), lc.RequestLease)
    assert ask.holding == (0, 1)
    assert core.handle(lc.Leased(0, [2], held=(1,)), 0.3) == [lc.StartTicket(0, 2)]
    # A completion still on its way to the coordinator when an answer names the ticket held: not started again.
    assert only(core.handle(lc.Completed(0, 0, ["a", "b"], 2.0), 0.4), lc.ReportComplete)
    (ask,) = only(core.poll(0.4 + lc.LEASE_RETRY_S, in_flight=2, has_next_stage=True), lc.RequestLease)
    assert ask.holding == (0, 1, 2)
    assert core.handle(lc.Leased(0, [], held=(0,)), 0.5) == []


def test_a_reopened_step_is_leased_at_once_whatever_back_off_its_empty_answers_built() -> None:
    """Adversary sim seed 379 (redo_storm, 2 of 5): with the back-off kept across a reopen, an honest stage-0 replica
    asked for the redone tickets up to 2 s late, held the commit, and was struck ``commit_hold``. Driving the step
    again (a reopen, or the next step) starts the lease questions afresh."""
    core = lease_core()
    now = 0.0
    for _ in range(8):  # a long run of empty answers: the pause has grown to its cap
        while not only(core.poll(now, in_flight=0, has_next_stage=True), lc.RequestLease):
            now = core.next_wake(now)
        core.handle(lc.Leased(0, []), now)
    soon = now + 2 * lc.LEASE_RETRY_S
    assert not only(core.poll(soon, in_flight=0, has_next_stage=True), lc.RequestLease), "backed off"
    core.begin(0, [], soon)  # the step reopened
    assert only(core.poll(soon, in_flight=0, has_next_stage=True), lc.RequestLease)
    core.handle(lc.Leased(0, []), soon)  # its redone tickets went to another replica first: ask again soon
    assert only(core.poll(soon + 2 * lc.LEASE_RETRY_S, in_flight=0, has_next_stage=True), lc.RequestLease)


def test_completions_are_reported_failures_released_and_bad_routes_handed_back() -> None:
    core = lease_core()
    core.poll(0.0, in_flight=0, has_next_stage=True)
    core.handle(lc.Leased(0, [0, 1]), 0.0)
    assert core.handle(lc.Completed(0, 0, ["a", "b"], 2.0), 0.5) == [lc.ReportComplete(0, 0, ["a", "b"], 2.0)]
    assert core.handle(lc.NotStarted(0, 1), 0.5) == [lc.Release(0, [1])]
    assert core.started == {}
    actions = core.handle(lc.CompleteRefused(0, 0, "bad_route", "moved"), 0.6)
    assert only(actions, lc.Release) == [lc.Release(0, [0])]
    # An attempt whose ack or loss does not check out is handed back too, and the ack rides along.
    assert core.handle(lc.Completed(0, 0, ["a", "b"], 2.0, b"sig"), 0.6) == [lc.ReportComplete(0, 0, ["a", "b"], 2.0, b"sig")]
    for code in ("bad_ack", "bad_loss"):
        assert only(core.handle(lc.CompleteRefused(0, 0, code, "no"), 0.6), lc.Release) == [lc.Release(0, [0])]
    assert only(core.handle(lc.CompleteRefused(0, 0, "duplicate", "dup"), 0.6), lc.Release) == []


def test_a_lease_answered_with_the_next_step_hands_it_back_and_keeps_asking_in_case_the_step_reopens() -> None:
    core = lease_core()
    core.poll(0.0, in_flight=0, has_next_stage=True)
    assert core.handle(lc.Leased(1, [0, 1]), 0.1) == [lc.Release(1, [0, 1])]
    assert core.poll(0.2, in_flight=0, has_next_stage=True) == []
    assert core.poll(0.1 + lc.CLOSED_RETRY_S, in_flight=0, has_next_stage=True) == [lc.RequestLease(2)]
    assert core.handle(lc.Leased(0, [3]), 0.5) == [lc.StartTicket(0, 3)]  # it reopened: redo ticket 3
    assert only(core.handle(lc.LeaseFailed("unreachable"), 0.6), lc.Release) == []
    assert core.poll(0.7, in_flight=1, has_next_stage=True) == []  # waits LEASE_FAILED_S
