"""Step accounting: leases, expiry and re-issue, exactly B tickets per step, duplicates and redo (I1)."""

from __future__ import annotations

import random

from protolearn.coordinator.core.steps import DROPPED
from protolearn.coordinator.core.tickets import TicketLedger

B, S = 6, 2


def ledger(**kw) -> TicketLedger:
    return TicketLedger(B, S, lease_s=10.0, block=kw.pop("block", 4), **kw)


def finish(led: TicketLedger, peer: str, now: float, stage1: str = "s1", *, commit: bool = False) -> None:
    """Lease and complete everything of the open step as ``peer``; ``commit``: both stages report averaging it."""
    step = led.step
    while led.step == step:
        d = led.lease(peer, now, 4)
        assert d.indices, d.reason
        for i in d.indices:
            assert led.complete(peer, step, i, [peer, stage1], float(i), now).accepted
    if commit:
        revision = led.closed[step].revision
        assert led.averaged(peer, 0, step, revision).accepted
        assert led.averaged(stage1, 1, step, revision).committed


def test_lease_hands_out_small_blocks_until_the_step_is_fully_leased() -> None:
    led = ledger()
    a = led.lease("a", 0.0, 100)
    b = led.lease("b", 0.0, 100)
    c = led.lease("c", 0.0, 100)
    assert a.indices == [0, 1, 2, 3] and b.indices == [4, 5]
    assert c.indices == [] and "wait" in c.reason


def test_step_closes_after_exactly_B_completions_with_frozen_accounting() -> None:
    led = ledger()
    a = led.lease("a", 0.0, 3).indices
    b = led.lease("b", 0.0, 3).indices
    closed = None
    for peer, idx in [("a", a), ("b", b)]:
        for i in idx:
            d = led.complete(peer, 0, i, [peer, "x" if i % 2 else "y"], float(i), 1.0)
            assert d.accepted, d.reason
            closed = d.closed or closed
    assert closed is not None and closed.step == 0 and closed.revision == 1
    assert closed.num_tickets == B
    assert closed.loss == sum(range(B)) / B
    acc = closed.accounting()
    assert acc[0] == {"a": [0, 1, 2], "b": [3, 4, 5]}
    assert acc[1] == {"x": [1, 3, 5], "y": [0, 2, 4]}
    # every stage accounts for every ticket exactly once
    for stage in range(S):
        assert sorted(i for ts in acc[stage].values() for i in ts) == list(range(B))
    assert led.step == 1 and led.remaining() == B


def test_next_step_is_leasable_only_after_the_current_one_closed_and_committed() -> None:
    led = ledger()
    held = led.lease("a", 0.0, 4).indices + led.lease("a", 0.0, 4).indices
    assert held == list(range(B))
    assert led.lease("b", 0.0, 4).indices == []
    for i in held[:-1]:
        led.complete("a", 0, i, ["a", "z"], 1.0, 0.0)
    assert led.lease("b", 0.0, 4).step == 0 and led.lease("b", 0.0, 4).indices == []
    led.complete("a", 0, held[-1], ["a", "z"], 1.0, 0.0)
    d = led.lease("b", 0.0, 4)
    assert d.step == 1 and d.indices == [] and "not committed" in d.reason
    assert not led.averaged("a", 0, 0, 1).committed
    assert led.averaged("z", 1, 0, 1).committed
    d = led.lease("b", 0.0, 4)
    assert d.step == 1 and d.indices == [0, 1, 2, 3]


def test_expired_lease_is_reissued_and_the_late_completion_is_refused() -> None:
    led = ledger()
    mine = led.lease("slow", 0.0, 4).indices
    led.lease("other", 5.0, 4)
    assert led.expired(5.0) == []
    assert led.expired(11.0) == sorted(mine)
    d = led.lease("fast", 11.0, 4)
    assert d.indices == mine and d.reissued == mine
    late = led.complete("slow", 0, mine[0], ["slow", "z"], 1.0, 12.0)
    assert not late.accepted and late.code == "not_leaseholder"
    assert led.complete("fast", 0, mine[0], ["fast", "z"], 1.0, 12.0).accepted


def test_a_lease_that_ran_out_does_not_count_against_its_holders_share() -> None:
    """After a coordinator restart mid-step a holder can have lost track of a ticket it still held; once that
    lease runs out the holder is leased again (that ticket among others), not refused "finish those first"
    for good while the step never closes (node-core simulator, seed 3693)."""
    led = ledger()
    mine = led.lease("a", 0.0, 3, share=3).indices
    led.lease("b", 0.0, 3, share=3)
    assert led.lease("a", 5.0, 3, share=3).indices == [] and "its share" in led.lease("a", 5.0, 3, share=3).reason
    again = led.lease("a", 11.0, 3, share=3)
    assert again.indices and set(again.reissued) <= set(mine) | set(range(3, 6)), again


def test_original_holder_may_still_complete_an_expired_lease_nobody_took() -> None:
    led = ledger()
    i = led.lease("a", 0.0, 1).indices[0]
    assert led.complete("a", 0, i, ["a", "z"], 1.0, 100.0).accepted


def test_completion_refusals_never_count_twice() -> None:
    led = ledger()
    i = led.lease("a", 0.0, 1).indices[0]
    assert led.complete("b", 0, i, ["b", "z"], 1.0, 0.0).code == "not_leaseholder"
    assert led.complete("a", 0, 5, ["a", "z"], 1.0, 0.0).code == "not_leaseholder"  # never leased
    assert led.complete("a", 0, i, ["a"], 1.0, 0.0).code == "bad_route"
    assert led.complete("a", 0, i, ["x", "z"], 1.0, 0.0).code == "bad_route"
    assert led.complete("a", 0, i, ["a", "z"], float("nan"), 0.0).code == "bad_loss"
    assert led.complete("a", 0, 99, ["a", "z"], 1.0, 0.0).code == "bad_ticket"
    assert led.complete("a", 3, i, ["a", "z"], 1.0, 0.0).code == "step_not_open"
    assert led.complete("a", 0, i, ["a", "z"], 1.0, 0.0).accepted
    dup = led.complete("a", 0, i, ["a", "z"], 1.0, 0.0)
    assert not dup.accepted and dup.code == "duplicate"
    assert led.remaining() == B - 1


def test_redo_on_the_open_step_frees_a_completed_ticket() -> None:
    led = ledger()
    idx = led.lease("a", 0.0, 4).indices
    for i in idx:
        led.complete("a", 0, i, ["a", "broken"], 1.0, 0.0)
    assert not led.redo(0, [idx[0]], by="stranger").accepted
    d = led.redo(0, [idx[0]], by="broken")
    assert d.accepted and not d.reopened and d.indices == [idx[0]]
    assert led.remaining() == B - len(idx) + 1
    # The ticket is leasable again and completes once more, still counted once.
    again = led.lease("b", 1.0, 4).indices
    assert idx[0] in again


def test_redo_reopens_the_step_that_just_closed_and_it_closes_again_with_a_new_revision() -> None:
    led = ledger()
    finish(led, "a", 0.0, stage1="dead")
    assert led.step == 1
    d = led.redo(0, [1, 2], by="dead")
    assert d.accepted and d.reopened and led.step == 0 and led.remaining() == 2
    idx = led.lease("a", 1.0, 4).indices
    assert idx == [1, 2]
    closed = None
    for i in idx:
        closed = led.complete("a", 0, i, ["a", "alive"], 0.5, 2.0).closed or closed
    assert closed is not None and closed.revision == 2
    acc = closed.accounting()
    assert acc[1] == {"alive": [1, 2], "dead": [0, 3, 4, 5]}
    assert led.step == 1


def test_a_committed_step_never_reopens_and_a_reopen_needs_every_stage_to_average_again() -> None:
    led = ledger()
    finish(led, "a", 0.0)
    assert led.averaged("a", 0, 0, 1).accepted
    d = led.redo(0, [1], by="s1", by_stage=1)
    assert d.reopened
    assert not led.averaged("a", 0, 0, 1).accepted  # step 0 is open again: nothing to vouch for
    redo = led.lease("a", 1.0, 4)
    assert redo.step == 0 and redo.indices == [1]
    assert led.complete("a", 0, 1, ["a", "s1"], 1.0, 1.0).closed is not None
    assert led.closed[0].revision == 2
    stale = led.averaged("a", 0, 0, 1)
    assert not stale.accepted and stale.code == "stale_revision"
    assert not led.averaged("s1", 1, 0, 2).committed  # stage 0's report was for revision 1
    assert led.averaged("a", 0, 0, 2).committed
    d = led.redo(0, [0])
    assert not d.accepted and d.code == "step_committed"
    assert not led.redo(7, [0]).accepted


def test_random_schedules_close_every_step_with_exactly_B_distinct_tickets() -> None:
    rng = random.Random(1)
    led = ledger(block=2)
    peers = ["p0", "p1", "p2"]
    now = 0.0
    closed = []
    for _ in range(2000):
        now += rng.uniform(0, 4)
        peer = rng.choice(peers)
        op = rng.random()
        if op < 0.4:
            led.lease(peer, now, rng.randint(1, 3))
        elif op < 0.9:
            held = [t.index for t in led.tickets if t.holder is not None]
            if held:
                d = led.complete(peer, led.step, rng.choice(held), [peer, "s1"], 1.0, now)
                if d.closed:
                    closed.append(d.closed)
                    for stage, peers_ in d.closed.accounting().items():  # one participant per stage reports
                        led.averaged(min(peers_), stage, d.closed.step, d.closed.revision)
        elif op < 0.95:
            done = [t.index for t in led.tickets if t.done]
            if done:
                led.redo(led.step, [rng.choice(done)])
        else:
            led.release(peer, led.step, led.holdings(peer))
    assert len(closed) > 5
    for c in closed:
        assert c.num_tickets == B
        for stage, peers_ in c.accounting().items():
            assert sorted(i for ts in peers_.values() for i in ts) == list(range(B)), (c.step, stage)
    assert [c.step for c in closed] == list(range(len(closed)))


def test_a_surviving_replica_of_the_stage_may_redo_a_dead_replicas_tickets_but_a_stranger_may_not() -> None:
    led = ledger()
    # Tickets alternate between two stage-1 replicas; "dead" died while averaging the step.
    step = led.step
    while led.step == step:
        for i in led.lease("a", 0.0, 4).indices:
            led.complete("a", 0, i, ["a", "alive" if i % 2 else "dead"], 1.0, 0.0)
    dead_tickets = [0, 2, 4]
    # Not a participant of the step at stage 1 (or asking from another stage): refused, nothing changes.
    assert not led.redo(0, dead_tickets, by="newcomer", by_stage=1).accepted
    assert not led.redo(0, dead_tickets, by="alive", by_stage=0).accepted
    assert led.step == 1
    d = led.redo(0, dead_tickets, by="alive", by_stage=1)
    assert d.accepted and d.reopened and led.remaining() == 3
    # A second survivor's identical request on the reopened step is a no-op, not a second reset.
    again = led.redo(0, dead_tickets, by="alive", by_stage=1)
    assert again.accepted and again.indices == []
    for i in led.lease("b", 1.0, 4).indices:
        closed = led.complete("b", 0, i, ["b", "alive"], 2.0, 1.0).closed
    assert closed is not None and closed.revision == 2
    # Exactly B tickets, each counted once per stage (I1), the dead replica's share recomputed elsewhere.
    assert closed.accounting()[1] == {"alive": list(range(B))}
    assert sorted(i for ts in closed.accounting()[0].values() for i in ts) == list(range(B))


def test_a_late_same_stage_redo_leaves_tickets_already_redone_alone() -> None:
    led = ledger()
    step = led.step
    while led.step == step:
        for i in led.lease("a", 0.0, 4).indices:
            led.complete("a", 0, i, ["a", "alive" if i % 2 else "dead"], 1.0, 0.0)
    assert led.redo(0, [0, 2, 4], by="alive", by_stage=1).reopened
    i = led.lease("b", 1.0, 1).indices[0]
    led.complete("b", 0, i, ["b", "alive"], 2.0, 1.0)
    # "dead"'s tickets: one already recomputed, two pending; a carried-over ticket of "dead" is not there.
    d = led.redo(0, [0, 2, 4], by="alive", by_stage=1)
    assert d.accepted and d.indices == []
    assert led.tickets[i].done and led.tickets[i].route == ["b", "alive"]
    # A ticket carried over from the frozen accounting can still be redone by a same-stage participant.
    d = led.redo(0, [1], by="alive", by_stage=1)
    assert d.accepted and d.indices == [1] and not led.tickets[1].done


def test_a_dead_holders_leases_end_early_and_go_to_the_next_lease_but_count_if_it_completes() -> None:
    led = ledger()
    held = led.lease("a", 0.0, 2).indices
    assert led.expire_leases("a", 1.0) == held
    assert led.expired(1.0) == held
    # a is still the holder until someone else leases: if it was alive after all, its completion counts
    assert led.complete("a", 0, held[0], ["a", "s1"], 1.0, 1.0).accepted
    d = led.lease("b", 1.5, 4)
    assert held[1] in d.reissued and held[0] not in d.indices


def test_drain_hands_over_dirty_tickets_then_all_of_them_after_a_close_and_the_commit_once() -> None:
    led = ledger()
    d = led.lease("a", 0.0, 2)
    ch = led.drain()
    # A fresh run persists "nothing committed" with its first drain (see TicketLedger.__init__).
    assert [t.index for t in ch.tickets] == d.indices and not ch.reset and ch.committed == -1
    assert led.drain() == type(ch)([], False, None)
    finish(led, "a", 20.0, commit=True)  # its first lease expired: re-issued to it
    ch = led.drain()
    assert ch.reset and [t.index for t in ch.tickets] == list(range(B)) and ch.committed == 0
    assert led.drain() == type(ch)([], False, None)


def test_restore_fills_missing_tickets_refreshes_leases_and_defaults_committed() -> None:
    led = ledger()
    finish(led, "a", 0.0, commit=True)
    leased = led.lease("a", 1.0, 2).indices
    held = [led.tickets[i] for i in leased]
    again = ledger()
    again.restore(step=1, tickets=held, closed=list(led.closed.values()), committed_through=None, now=50.0)
    assert again.step == 1 and again.holdings("a") == leased and again.remaining() == B
    assert all(again.tickets[i].expires_at == 60.0 for i in leased)  # a fresh term from the restart
    assert again.committed(0) and again.closed[0] == led.closed[0]
    ch = again.drain()
    assert [t.index for t in ch.tickets] == leased and not ch.reset and ch.committed is None


def test_only_the_newest_closed_steps_are_kept() -> None:
    led = ledger(keep_closed=2)
    for step in range(4):
        finish(led, "a", float(step), commit=True)
    assert sorted(led.closed) == [2, 3]


def test_a_run_that_drops_departures_keeps_their_done_tickets_and_drops_them_from_that_stage_only() -> None:
    """batch.departures = "drop" (issue 26): a peer that departs while the step is open costs its own stage the
    tickets it held, not a redo through every stage; its leased, unfinished tickets are still freed."""
    led = ledger(drop_departed=True)
    step = led.step
    d = led.lease("a", 0.0, 3)
    for i in d.indices:
        assert led.complete("a", step, i, ["a", "gone" if i < 2 else "s1"], 1.0, 0.0).accepted
    held = led.lease("x", 0.0, 1).indices
    assert led.revoke_peer("gone") == []  # its two done tickets stay done
    assert led.revoke_peer("x") == held  # x's unfinished lease is freed
    while led.step == step:
        got = led.lease("b", 0.0, 4)
        for i in got.indices:
            assert led.complete("b", step, i, ["b", "s1"], 1.0, 0.0).accepted
    account = led.closed[step].accounting()
    assert sorted(account[1]["s1"]) == sorted(set(range(B)) - {0, 1})  # stage 1 lost the departed's tickets
    assert "gone" not in account[1] and "" not in account[1]
    assert sorted(t for ts in account[0].values() for t in ts) == list(range(B))  # stage 0 keeps every ticket


def test_by_default_a_departure_frees_every_ticket_routed_through_it() -> None:
    led = ledger()
    step = led.step
    d = led.lease("a", 0.0, 2)
    for i in d.indices:
        assert led.complete("a", step, i, ["a", "gone"], 1.0, 0.0).accepted
    assert led.revoke_peer("gone") == sorted(d.indices)


def test_indexed_leases_pick_what_a_scan_of_every_ticket_picks() -> None:
    """The ledger indexes free tickets, each holder's tickets and the earliest lease end; a seeded run of leases,
    completions, releases, ended leases, departures and redo over several steps must lease exactly the tickets a
    scan of every ticket gives (expired ones first, then free ones, in index order), and report the same holdings
    and expired leases."""
    rng = random.Random(5)
    led = TicketLedger(40, 2, lease_s=10.0, block=3, drop_departed=False)
    peers = ["a", "b", "c", "d"]
    now = 0.0
    for _ in range(4000):
        now += rng.choice([0.0, 0.5, 3.0])
        peer, op = rng.choice(peers), rng.random()
        tickets = led.tickets
        assert led.expired(now) == [t.index for t in tickets if not t.done and t.holder is not None and t.expires_at <= now]
        for p in peers:
            assert led.holdings(p, now) == [t.index for t in tickets if t.holder == p and not t.done and t.expires_at > now]
            assert led.holdings(p) == [t.index for t in tickets if t.holder == p and not t.done]
        if op < 0.45:
            expired = [t.index for t in tickets if not t.done and t.holder is not None and t.expires_at <= now]
            free = [t.index for t in tickets if not t.done and t.holder is None]
            held = len([t for t in tickets if t.holder == peer and not t.done and t.expires_at > now])
            n = min(3, 6 - held)
            d = led.lease(peer, now, 3, share=6)
            if d.indices:
                assert d.indices == sorted((expired + free)[:n])
        elif op < 0.8:
            mine = led.holdings(peer)
            if mine:
                i = rng.choice(mine)
                led.complete(peer, led.step, i, [peer, "s1"], 1.0, now)
        elif op < 0.85:
            led.release(peer, led.step, rng.sample(range(40), 5))
        elif op < 0.9:
            led.expire_leases(peer, now)
        elif op < 0.93:
            led.revoke_peer(peer)
        elif op < 0.96 and led.step > 0 and led.last_closed == led.step - 1 and not led.committed(led.last_closed):
            led.redo(led.step - 1, [rng.randrange(40)], by=peer)
        if led.step > 0 and not led.committed(led.last_closed) and rng.random() < 0.3:
            step, revision = led.last_closed, led.closed[led.last_closed].revision
            led.averaged("a", 0, step, revision)
            led.averaged("s1", 1, step, revision)
    assert led.step >= 3, "the run went through several steps"


def _scan_revoke(tickets: list, peer: str, drop: bool) -> tuple[list[int], list[tuple]]:
    """revoke_peer as one scan of every ticket (what the ledger did before its route index): the oracle."""
    out, after = [], []
    for i, t in enumerate(tickets):
        route = list(t.route or ())
        routed = t.done and peer in route
        if routed and drop:
            after.append((True, tuple(DROPPED if p == peer else p for p in route)))
        elif (t.holder == peer and not t.done) or routed:
            out.append(i)
            after.append((False, ()))
        else:
            after.append((t.done, tuple(route)))
    return out, after


def test_the_ledgers_indexes_answer_as_a_scan_of_every_ticket_over_random_histories(rng: random.Random) -> None:
    """The done count and the per-peer route index (kept on every lease, completion, redo, departure, close and
    reopen) against a scan of the tickets after each operation, in both departure modes."""
    peers = ["a", "b", "c", "d", "e"]
    for drop in (False, True):
        led = TicketLedger(12, 3, lease_s=5.0, block=3, drop_departed=drop)
        now = 0.0
        for _ in range(1500):
            now += rng.choice([0.0, 0.5, 2.0])
            op = rng.random()
            if op < 0.3:
                led.lease(rng.choice(peers), now, 3)
            elif op < 0.8:
                held = [(t.holder, t.index) for t in led.tickets if t.holder is not None and not t.done]
                if held:
                    peer, i = rng.choice(held)
                    led.complete(peer, led.step, i, [peer, rng.choice(peers), rng.choice(peers)], 1.0, now)
            elif op < 0.85:
                before = [(t.done, tuple(t.route or ()), t.holder) for t in led.tickets]
                peer = rng.choice(peers)
                want, after = _scan_revoke(led.tickets, peer, drop)
                assert led.revoke_peer(peer) == want, before
                assert [(t.done, tuple(t.route or ()) if t.done else ()) for t in led.tickets] == after
            elif op < 0.9:
                led.redo(led.step, rng.sample(range(12), 2), by=rng.choice(peers + [None]))
            elif led.closed:
                last = max(led.closed)
                if led.committed(last):
                    pass
                elif rng.random() < 0.3:
                    led.redo(last, [rng.randrange(12)], by=None)  # reopen it
                else:  # every stage's replicas report the round: it commits
                    for stage in range(3):
                        for p in sorted(led.closed[last].accounting().get(stage, {})):
                            led.averaged(p, stage, last, led.closed[last].revision)
            assert led.remaining() == sum(1 for t in led.tickets if not t.done)
            for closed in led.closed.values():
                for stage in range(3):
                    for p in peers + [DROPPED]:
                        assert closed.processed_at(p, stage) == any(r[stage] == p for r in closed.routes)
        assert led.step >= 3, led.step  # the history closed, reopened and committed steps
