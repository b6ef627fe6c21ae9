"""A step closes at a quorum of its tickets after a grace window, in a run that drops departures (close_rule.py).

Fake clock: the ledger's and the coordinator core's ``now`` arguments.
"""

from __future__ import annotations

import math

import pytest

from protolearn.coordinator.core.changes import Changes
from protolearn.coordinator.core.close_rule import CloseRule
from protolearn.coordinator.core.steps import DROPPED
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.store import Store
from protolearn.errors import ConfigError
from protolearn.stages.config import default_run

B, S = 10, 2


def ledger(quorum: float = 0.8, grace: float = 0.5) -> TicketLedger:
    return TicketLedger(B, S, lease_s=100.0, block=B, drop_departed=True, close_rule=CloseRule(quorum, grace))


def complete(led: TicketLedger, indices: list[int], now: float, peer: str = "a") -> None:
    for i in indices:
        assert led.complete(peer, led.step, i, [peer, "s1"], float(i), now).accepted


def test_the_step_closes_without_its_slowest_tickets_once_the_grace_after_its_quorum_ends() -> None:
    led = ledger(quorum=0.8, grace=0.5)
    assert led.lease("a", 10.0, B).indices == list(range(B))  # opened at 10
    complete(led, list(range(7)), 20.0)
    assert led.close_due(1000.0) is None  # 7 of 10: no quorum, however long it takes
    complete(led, [7], 30.0)  # quorum (8) at 30, 20 s after the first lease: grace 10 s
    assert led.close_due(39.9) is None and led.step == 0
    closed = led.close_due(40.0)
    assert closed is not None and led.step == 1 and closed.dropped == 2
    assert closed.routes[8] == closed.routes[9] == (DROPPED, DROPPED)
    account = closed.accounting()
    assert sorted(account[0]["a"]) == sorted(account[1]["s1"]) == list(range(8))  # no stage accounts a dropped ticket
    assert math.isnan(closed.losses[9]) and closed.loss == pytest.approx(sum(range(8)) / 8)  # mean of the done ones
    # The dropped tickets' late completions are refused, never counted.
    refused = led.complete("a", 0, 9, ["a", "s1"], 1.0, 41.0)
    assert not refused.accepted and refused.code == "step_closed"


def test_every_ticket_done_inside_the_grace_closes_the_step_at_once_with_none_dropped() -> None:
    led = ledger()
    led.lease("a", 0.0, B)
    complete(led, list(range(8)), 10.0)
    d = led.complete("a", 0, 8, ["a", "s1"], 1.0, 11.0)
    assert d.accepted and d.closed is None
    d = led.complete("a", 0, 9, ["a", "s1"], 1.0, 12.0)
    assert d.closed is not None and d.closed.dropped == 0 and not any(math.isnan(x) for x in d.closed.losses)
    assert led.close_due(100.0) is None  # the next step has no quorum yet


def test_the_grace_follows_the_steps_own_pace_and_a_redo_below_the_quorum_holds_it_open() -> None:
    fast, slow = ledger(grace=0.25), ledger(grace=0.25)
    for led, took in ((fast, 1.0), (slow, 400.0)):
        led.lease("a", 0.0, B)
        complete(led, list(range(8)), took)
    assert fast.close_due(1.25) is not None  # 1 s to the quorum: 0.25 s more
    assert slow.close_due(1.25) is None and slow.close_due(499.0) is None and slow.close_due(500.0) is not None
    # A redo on the open step that takes the done count under the quorum: the window's end does not close it.
    led = ledger(grace=0.25)
    led.lease("a", 0.0, B)
    complete(led, list(range(8)), 4.0)
    assert led.redo(0, [0], by="a").accepted
    assert led.close_due(100.0) is None and led.step == 0


def test_by_default_and_in_a_redo_run_a_step_closes_only_with_every_ticket() -> None:
    led = TicketLedger(B, S, lease_s=100.0, block=B, drop_departed=True)
    led.lease("a", 0.0, B)
    complete(led, list(range(9)), 1.0)
    assert led.close_due(1e9) is None and led.step == 0
    with pytest.raises(ValueError, match="drops departures"):
        TicketLedger(B, S, lease_s=100.0, block=B, close_rule=CloseRule(0.9))
    with pytest.raises(ConfigError, match="needs departures"):
        default_run().replace(**{"batch.close_quorum": 0.9})
    run = default_run().replace(**{"batch.close_quorum": 0.9, "batch.departures": "drop"})
    assert run.batch.close_quorum == 0.9


def test_a_reopened_step_keeps_its_dropped_tickets_dropped() -> None:
    led = ledger(quorum=0.8, grace=0.0)
    led.lease("a", 0.0, B)
    complete(led, list(range(8)), 1.0)
    first = led.close_due(1.0)
    assert first is not None and first.dropped == 2
    assert led.redo(0, [3], by="a", by_stage=0, revision=1).reopened
    got = led.lease("a", 2.0, B).indices
    assert got == [3]  # only the ticket asked for: the dropped ones are not leased again
    complete(led, [3], 3.0)
    again = led.closed[0]
    assert again.revision == 2 and again.dropped == 2 and sorted(again.accounting()[1]["s1"]) == list(range(8))


def test_a_step_closed_at_its_quorum_and_reopened_survives_a_coordinator_restart(tmp_path) -> None:
    """Real SQLite: the closed step keeps its dropped tickets; the reopened step's dropped tickets (loss NaN, which
    SQLite stores as NULL) still close as dropped after a restore."""
    led = ledger(quorum=0.8, grace=0.0)
    led.lease("a", 0.0, B)
    complete(led, list(range(8)), 1.0)
    closed = led.close_due(1.0)
    assert closed is not None
    assert led.redo(0, [3], by="a", by_stage=0, revision=1).reopened
    store = Store(tmp_path)
    ch = led.drain()
    store.apply(Changes(step=led.step, tickets=ch.tickets, tickets_reset=ch.reset, closed=[closed], committed=ch.committed))
    loaded = store.load()
    back = [c for c in loaded["closed"] if c.step == 0][0]
    assert back.dropped == 2 and back.routes == closed.routes and back.loss == closed.loss and math.isnan(back.losses[9])
    again = ledger(quorum=0.8, grace=0.0)
    again.restore(step=loaded["step"], tickets=loaded["tickets"], closed=loaded["closed"], committed_through=loaded["committed"], now=5.0)
    assert again.lease("a", 6.0, B).indices == [3]
    complete(again, [3], 7.0)
    assert again.closed[0].revision == 2 and again.closed[0].dropped == 2 and again.closed[0].loss == pytest.approx(sum(range(8)) / 8)


def test_the_coordinator_closes_a_step_at_its_quorum_in_housekeeping_and_the_swarm_goes_on() -> None:
    """The whole core: a stage-0 peer that leased two tickets and went quiet (alive, connected) no longer holds
    the step; housekeeping closes it, the long poll's accounting leaves the two out, and it commits."""
    from protolearn.coordinator.config import CoordinatorSettings
    from protolearn.protocol import coordination as cm
    from tests.support.coordinator import TEST_ACK, join, make_core, run_info

    core = make_core(run_info(2, microbatches=10, departures="drop", close_quorum=0.8, close_grace=0.5),
                     CoordinatorSettings(lease_block=8), verify=lambda p, d, s: True)
    for peer in ("a", "b", "c"):
        join(core, peer)
    s0 = [p for p in ("a", "b", "c") if core.registry.members[p].stage == 0]
    s1 = [p for p in ("a", "b", "c") if core.registry.members[p].stage == 1][0]
    quiet, worker = s0[0], s0[1]
    held = core.handle(quiet, cm.Lease(max_tickets=2), 0.0)
    assert isinstance(held, cm.LeaseReply) and len(held.indices) == 2
    lease = core.handle(worker, cm.Lease(max_tickets=8), 2.0)
    assert len(lease.indices) == 8
    for i in lease.indices:
        reply = core.handle(worker, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=[worker, s1], loss=2.0), 2.0)
        assert not reply.step_closed
    core.housekeeping(2.9)  # quorum at 2.0, 2 s after the first lease: a grace of 1 s
    assert core.ledger.step == 0
    events = core.housekeeping(3.0)
    assert core.ledger.step == 1 and any("at its quorum: 2 of 10 tickets dropped" in e for e in events)
    info = core.step_info(0)
    assert info.closed and info.num_tickets == 10
    accounted = {t for acc in info.accounting for pt in acc.peers for t in pt.tickets}
    assert accounted == set(range(10)) - set(held.indices)  # no stage accounts the dropped two
    assert not core.handle(worker, cm.Averaged(step=0, revision=1), 4.0).committed
    assert core.handle(s1, cm.Averaged(step=0, revision=1), 4.0).committed
    late = held.indices[0]
    with pytest.raises(Exception, match="closed"):
        core.handle(quiet, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, late), step=0, index=late, route=[quiet, s1], loss=2.0), 5.0)
    assert core.handle(worker, cm.Lease(max_tickets=8), 5.0).indices  # the next step leases
