"""The balancer sends work where it will finish first, avoids failing peers and never uses banned ones."""

from __future__ import annotations

from protolearn.node.core.balancer import Balancer


def test_fast_peer_gets_work_until_its_queue_makes_it_slower() -> None:
    b = Balancer()
    b.on_sent("fast")
    b.on_done("fast", 0.125)
    b.on_sent("slow")
    b.on_done("slow", 0.375)
    picks = []
    for _ in range(4):
        c = b.choose(["slow", "fast"], now=0.0)
        picks.append(c.peer)
        b.on_sent(c.peer)
    # fast: 1*0.125, 2*0.125, 3*0.125 ties slow's 0.375 (smaller id wins), then 4*0.125 > 0.375.
    assert picks == ["fast", "fast", "fast", "slow"]


def test_reported_queue_steers_work_away() -> None:
    b = Balancer()
    for p in ("a", "b"):
        b.on_sent(p)
        b.on_done(p, 0.1)
    for _ in range(10):
        b.on_queue_report("a", 8)
    c = b.choose(["a", "b"], now=0.0)
    assert c.peer == "b"
    assert "least expected finish" in c.reason


def test_failure_penalty_avoids_a_peer_then_decays() -> None:
    b = Balancer(failure_penalty_s=5.0, penalty_half_life_s=1.0)
    for p in ("a", "b"):
        b.on_sent(p)
        b.on_done(p, 0.1)
    b.on_sent("a")
    b.on_failure("a", now=100.0)
    assert b.choose(["a", "b"], now=100.0).peer == "b"
    # After ten half-lives the penalty is ~5 ms: one queued microbatch on "b" now outweighs it.
    b.on_sent("b")
    assert b.choose(["a", "b"], now=110.0).peer == "a"


def test_banned_peers_are_never_chosen() -> None:
    b = Balancer()
    b.ban("evil")
    assert b.choose(["evil", "good"], now=0.0).peer == "good"
    c = b.choose(["evil"], now=0.0)
    assert c.peer is None and "banned" in c.reason
    assert "no peer" in b.choose([], now=0.0).reason


def test_unknown_peer_is_assumed_average() -> None:
    b = Balancer()
    b.on_sent("known")
    b.on_done("known", 1.0)
    b.on_sent("known")  # now one outstanding: expected 2.0 s there, vs 1.0 s on the new one
    assert b.choose(["known", "new"], now=0.0).peer == "new"


def test_an_idle_replica_gets_work_while_the_other_owes_gradients() -> None:
    """Two replicas that each accept at once report empty queues; the hand-overs each still owes a gradient
    are its load, so work alternates instead of every microbatch going to the smaller peer id."""
    from protolearn.node.core.routing import RouteCore

    r = RouteCore()
    r.next_peers = ["a", "b"]
    picks = []
    for t in range(4):
        peer = r.choose(set(), 0.0).peer
        assert peer is not None
        picks.append(peer)
        r.sending(peer)
        r.accepted((0, t), peer, service_s=0.01, queue_len=0, now=0.0)
    assert picks == ["a", "b", "a", "b"]
    r.returned((0, 0), 0.1)
    r.returned((0, 2), 0.1)  # "a" owes nothing now, "b" two
    assert r.choose(set(), 0.2).peer == "a"


def test_a_peer_not_ready_for_the_step_is_skipped_briefly_not_penalised() -> None:
    from protolearn.node.core.balancer import NOT_READY_S
    from protolearn.node.core.routing import RouteCore

    r = RouteCore()
    r.next_peers = ["a", "b"]
    for p in ("a", "b"):
        r.sending(p)
        r.accepted((0, 0 if p == "a" else 1), p, service_s=0.01, queue_len=0, now=0.0)
    r.returned((0, 0), 0.05)
    r.returned((0, 1), 0.05)
    r.refused("a", "ahead", 1.0)  # "a" is still syncing: behind this step
    assert r.choose(set(), 1.0).peer == "b"
    assert r.choose({"b"}, 1.0).peer == "a", "once the ready one was tried, the skipped one is tried (it may have caught up)"
    assert r.choose(set(), 1.0 + NOT_READY_S + 0.01).peer == "a", "no penalty outlives the skip"
    # Refusals in a row double the skip; an accepted microbatch resets it.
    r.refused("a", "ahead", 2.0)
    assert r.choose(set(), 2.0 + NOT_READY_S + 0.01).peer == "b"
    assert r.choose(set(), 2.0 + 2 * NOT_READY_S + 0.01).peer == "a"
    r.sending("a")
    r.accepted((1, 0), "a", service_s=0.01, queue_len=0, now=3.0)
    r.returned((1, 0), 3.05)
    r.refused("a", "ahead", 4.0)
    assert r.choose(set(), 4.0 + NOT_READY_S + 0.01).peer == "a"
    # Any other refusal is a failure: its penalty outlasts the skip.
    r.refused("a", "invalid", 5.0)
    assert r.choose(set(), 5.0 + NOT_READY_S + 0.01).peer == "b"
    # Only not-ready peers left: the choice still names one (the sender paces its retries).
    only = RouteCore()
    only.next_peers = ["c"]
    only.refused("c", "ahead", 0.0)
    assert only.choose(set(), 0.0).peer == "c"


# -- admission and per-step accounting (node/core/accounting.py): the other half of routing decisions --

from protolearn.node.core.accounting import Accounting, contribution


def test_next_step_work_waits_until_the_current_step_is_applied() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=2, max_deferred=2)
    assert acc.admit_forward(0, 0).action == "process"
    d = acc.admit_forward(1, 0, payload="early")
    assert d.action == "defer"
    acc.backward_done(0, 0)
    assert acc.accumulated(0) == [0]
    assert acc.applied_step(0) == ["early"]
    assert acc.step == 1
    stale = acc.admit_forward(0, 1)
    assert stale.action == "refuse" and "stale step 0" in stale.reason
    ahead = acc.admit_forward(3, 0)
    assert ahead.action == "refuse" and "ahead" in ahead.reason


def test_unknown_duplicate_and_out_of_range_microbatches_are_refused() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=8, max_deferred=2)
    unknown = acc.admit_backward(0, 2)
    assert unknown.action == "refuse" and "unknown microbatch" in unknown.reason
    assert acc.admit_forward(0, 2).action == "process"
    assert acc.admit_backward(0, 2).action == "process"
    early = acc.admit_forward(1, 2, payload="x")
    assert early.action == "defer"
    dup = acc.admit_forward(1, 2, payload="x")
    assert dup.action == "refuse" and "duplicate" in dup.reason
    bad = acc.admit_forward(0, 4)
    assert bad.action == "refuse" and "outside 0..3" in bad.reason


def test_every_refusal_carries_the_code_the_senders_retry_logic_keys_on() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=1, max_deferred=1)
    assert acc.admit_backward(0, 0).code == "unknown"
    assert acc.admit_forward(0, 9).code == "invalid"
    assert acc.admit_forward(0, 0).action == "process" and acc.admit_forward(0, 1).code == "busy"
    assert acc.admit_forward(1, 0, payload="x").action == "defer"
    assert acc.admit_forward(1, 0, payload="x").code == "duplicate"
    assert acc.admit_forward(1, 1, payload="y").code == "busy"
    assert acc.admit_forward(5, 0).code == "ahead"
    assert acc.admit_backward(0, 0).action == "process" and acc.admit_backward(0, 0).code == "unknown"
    acc.backward_done(0, 0)
    acc.applied_step(0)
    assert acc.admit_forward(0, 2).code == "stale"


def test_in_flight_and_deferred_work_are_bounded() -> None:
    acc = Accounting(microbatches_per_step=8, max_in_flight=2, max_deferred=1)
    assert [acc.admit_forward(0, i).action for i in range(3)] == ["process", "process", "refuse"]
    assert "busy" in acc.admit_forward(0, 3).reason
    acc.backward_done(0, 0)
    assert acc.admit_forward(0, 3).action == "process"
    assert acc.admit_forward(1, 0).action == "defer"
    assert "busy" in acc.admit_forward(1, 1).reason


def test_mismatch_with_the_coordinators_account_is_reported() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=4, max_deferred=1)
    for t in (1, 3):
        acc.admit_forward(0, t)
        acc.backward_done(0, t)
    assert acc.mismatch(0, [1, 3]) == ""
    assert "accumulated [1, 3]" in acc.mismatch(0, [1, 2, 3])


def test_a_redone_ticket_is_processed_again_and_counted_once() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=4, max_deferred=1)
    assert acc.admit_forward(0, 1).action == "process"
    # Stage 0 restarted the ticket while its first attempt was still held here (its route broke further on).
    again = acc.admit_forward(0, 1)
    assert again.action == "process" and "redo" in again.reason
    assert acc.num_in_flight == 1
    acc.backward_done(0, 1)
    # A redo after this replica's backward (a later stage died before the gradient reached stage 0).
    assert "redo" in acc.admit_forward(0, 1).reason
    acc.backward_done(0, 1)
    assert acc.accumulated(0) == [1]


def test_the_step_sums_exactly_the_coordinators_tickets() -> None:
    summed, missing, dropped = contribution(assigned=[0, 2, 3], held=[0, 1, 2, 3])
    assert summed == [0, 2, 3]  # ticket 1's completion was refused: never in this replica's sum
    assert dropped == [1] and missing == []
    assert contribution(assigned=[0, 5], held=[0]) == ([0], [5], [])


def test_a_second_gradient_for_one_ticket_is_refused_while_the_first_is_applied() -> None:
    acc = Accounting(microbatches_per_step=4, max_in_flight=4, max_deferred=1)
    acc.admit_forward(0, 2)
    acc.admit_forward(0, 2)  # a redo: two attempts, each of which may send a gradient back
    assert acc.admit_backward(0, 2).action == "process"
    second = acc.admit_backward(0, 2)
    assert second.action == "refuse" and "already being applied" in second.reason
    acc.backward_done(0, 2)
    assert acc.admit_backward(0, 2).action == "refuse"  # the ticket's gradients are in: nothing left to apply


def test_senders_with_their_own_tie_order_spread_a_step_over_every_replica() -> None:
    """Issue 26: with one tie order for everybody (the smaller peer id), 31 senders that each had 4 tickets and no
    measurements yet all sent them to the same 4 replicas of the next stage; each sender ordering ties by its own
    id leaves (almost) no replica without work."""
    receivers = [f"r{i:02d}" for i in range(31)]

    def idle(order_of) -> int:
        load = dict.fromkeys(receivers, 0)
        for s in range(31):
            b, awaited = Balancer(order=order_of(s)), {}
            for _ in range(4):
                peer = b.choose(receivers, 0.0, awaited).peer
                awaited[peer] = awaited.get(peer, 0) + 1
                load[peer] += 1
        return sum(1 for n in load.values() if n == 0)

    assert idle(lambda s: "") == 27  # one order: every sender used r00..r03
    assert idle(lambda s: f"s{s:02d}") <= 3  # balls into bins: e^-4 of 31 expected idle


def _reference_choice(b: Balancer, candidates: list[str], now: float, awaited: dict[str, int]) -> tuple[str | None, float]:
    """The choice as the module docstring states it, computed the plain way (min over the sorted candidates of
    (expected finish, tie rank)), to hold the inlined :meth:`Balancer.choose` to."""
    usable = sorted(set(candidates) - b._banned)
    if not usable:
        return None, float("inf")
    ready = [p for p in usable if b._get(p).not_ready_until <= now] or usable
    known = [s.service_s for s in b._stats.values() if s.service_s is not None]
    mean = sum(known) / len(known) if known else b.default_service_s
    # The balancer keeps the sum as measurements change, so its mean may differ from this one in the last bits.
    prior = b._prior()
    assert abs(prior - mean) <= 1e-12 * max(1.0, mean), (prior, mean)
    best = min(ready, key=lambda p: (b._finish(p, now, awaited.get(p, 0), prior), b._rank(p)))
    return best, b._finish(best, now, awaited.get(best, 0), prior)


def test_the_inlined_choice_is_the_least_expected_finish_with_its_tie_order() -> None:
    """A seeded history of sends, answers, failures, refusals and departures over 40 peers: every choice (whole
    stage, random subsets, with loads) equals the plain min over (expected finish, rank), ties included."""
    import random

    rng = random.Random(7)
    peers = [f"p{i:02d}" for i in range(40)]
    for order in ("", "me"):
        b = Balancer(order=order)
        for i in range(3000):
            now = i * 0.05
            p = rng.choice(peers)
            op = rng.random()
            if op < 0.3:
                b.on_sent(p)
            elif op < 0.5:
                b.on_done(p, rng.choice([0.1, 0.2, rng.random()]))
            elif op < 0.55:
                b.on_failure(p, now)
            elif op < 0.6:
                b.on_not_ready(p, now)
            elif op < 0.63:
                b.on_queue_report(p, rng.choice([0, 1, 3]))
            elif op < 0.64:
                b.forget(p)
            elif op < 0.645:
                b.ban(p)
            elif op < 0.65:
                b.suspects = frozenset(rng.sample(peers, 3))
            cands = peers if rng.random() < 0.5 else rng.sample(peers, rng.randint(1, 12))
            awaited = {q: rng.randint(0, 2) for q in rng.sample(peers, 5)}
            want = _reference_choice(b, cands, now, awaited)
            got = b.choose(cands, now, awaited)
            assert (got.peer, got.expected_s if got.peer else float("inf")) == want, (i, order)
