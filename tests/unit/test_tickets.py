"""The per-ticket record (node/core/tickets.py) and the routing decisions over it (node/core/routing.py).

One owner for what a replica knows of each microbatch: the attempt held and its route, where its outputs
went, and which hand-overs still await their gradient. The last test replays seeded random histories
against a model of the separate copies the router, the balancer and integrity used to keep, and checks
that every question they answered is answered the same way.
"""

from __future__ import annotations

import random

from protolearn.node.core import tickets as tk
from protolearn.node.core.accounting import Accounting, Admission
from protolearn.node.core.routing import RouteCore
from protolearn.node.core.tickets import Tickets


def test_a_redone_ticket_replaces_the_held_attempt_and_a_gradient_of_the_old_route_is_refused() -> None:
    r = RouteCore()
    acc = Accounting(microbatches_per_step=4, max_in_flight=4, max_deferred=1)
    acc.admit_forward(0, 1)
    r.tickets.hold((0, 1), ["s0", "a"])
    acc.admit_forward(0, 1)  # stage 0 redid the ticket: it came again, along another route
    r.tickets.hold((0, 1), ["s0b", "a"])
    old = r.admit_gradient((0, 1), ["s0", "a"], acc.admit_backward(0, 1))
    assert old.action == "refuse" and old.code == "unknown" and "redone along another route" in old.reason
    acc.gradient_moot(0, 1)
    assert r.admit_gradient((0, 1), ["s0b", "a"], acc.admit_backward(0, 1)).action == "process"
    # The accounting's own refusal passes through unchanged; a ticket with no attempt held is the accounting's call.
    refused = Admission("refuse", "unknown microbatch", "unknown")
    assert r.admit_gradient((0, 2), ["x", "a"], refused) is refused
    assert r.admit_gradient((0, 3), ["x", "a"], Admission("process", "ok")).action == "process"


def test_frames_and_who_got_each_output_are_kept_per_ticket() -> None:
    t = Tickets()
    t.received((2, 0), "input", "frame-in")
    t.sent((2, 0), "fwd", "b", "frame-b")
    t.sent((2, 0), "fwd", "c", "frame-c")  # b failed; the signed output went to c last
    t.sent((2, 0), "bwd", "a", "grad-out")
    assert t.frame((2, 0), "input") == "frame-in" and t.frame((2, 0), "grad") is None
    assert t.frame((2, 0), "fwd") == "frame-c"  # what the next stage's gradient names as its input
    assert t.sent_to((2, 0), "fwd") == "c" and t.sent_to((2, 0), "bwd") == "a"
    assert t.frame((2, 1), "input") is None and t.sent_to((2, 1), "fwd") is None
    t.keep_tokens((2, 0), "ids")
    assert t.tokens((2, 0)) == "ids" and t.tokens((9, 9)) is None


def test_a_hand_over_is_awaited_until_its_gradient_returns_or_it_is_overdue() -> None:
    t = Tickets()
    t.handed((0, 0), "a", 1.0)
    t.handed((0, 1), "b", 2.0)
    t.handed((0, 0), "c", 3.0)  # redone and handed to another peer: awaited from c, since 3.0
    assert t.handed_to(0, "a") == [] and t.handed_to(0, "c") == [0] and t.handed_to(0, "b") == [1]
    assert t.returned((0, 1), 2.5) == ("b", 0.5)
    assert t.returned((0, 1), 2.6) is None  # back already
    assert t.handed_to(0, "b") == [1]  # who took it last stays known (stage 0 restarts what a dead peer took)
    assert t.overdue(4.0, limit_s=2.0) == []
    assert t.overdue(5.5, limit_s=2.0) == [((0, 0), "c")]
    assert t.overdue(99.0, limit_s=2.0) == [] and t.returned((0, 0), 99.0) is None


def test_overdue_hand_overs_come_oldest_first_and_a_forgotten_peer_is_awaited_no_more() -> None:
    t = Tickets()
    for i, peer in enumerate(["a", "b", "a", "c"]):
        t.handed((1, i), peer, float(i))
    t.forget_peer("b")
    assert t.overdue(100.0, limit_s=1.0) == [((1, 0), "a"), ((1, 2), "a"), ((1, 3), "c")]


def test_pruning_forgets_applied_steps_but_keeps_awaiting_their_hand_overs() -> None:
    t = Tickets()
    for step in (0, 1):
        t.hold((step, 0), ["s0"])
        t.received((step, 0), "input", f"in{step}")
        t.sent((step, 0), "fwd", "b", f"out{step}")
        t.handed((step, 0), "b", 0.0)
    t.hold((0, 1), ["s0"])
    t.returned((0, 0), 0.1)  # step 0's ticket 0 came back; ticket 1 of step 0 was never handed
    t.handed((0, 2), "d", 0.0)
    t.prune(1)
    assert t.route((0, 0)) is None and t.route((0, 1)) is None and t.frame((0, 2), "input") is None
    assert len(t) == 2  # step 1's ticket, and step 0's awaited hand-over to d, with nothing else of it
    assert t.route((1, 0)) == ["s0"] and t.frame((1, 0), "input") == "in1" and t.sent_to((1, 0), "fwd") == "b"
    # Step 0's unanswered hand-over to d still counts as lost when overdue, whatever its step.
    assert t.overdue(10.0, limit_s=1.0) == [((1, 0), "b"), ((0, 2), "d")]
    t.prune(2)
    assert len(t) == 0


def test_awaited_hand_overs_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(tk, "MAX_AWAITED", 3)
    t = Tickets()
    for i in range(5):
        t.handed((0, i), "p", float(i))
    assert [k for k, _ in t.overdue(100.0, limit_s=0.0)] == [(0, 2), (0, 3), (0, 4)]


def test_choose_skips_the_peers_already_tried_until_all_were() -> None:
    r = RouteCore()
    r.next_peers = ["a", "b"]
    assert r.has_next_stage
    assert r.choose(set(), 0.0).peer == "a"
    assert r.choose({"a"}, 0.0).peer == "b"
    assert r.choose({"a", "b"}, 0.0).peer == "a"  # every one tried: all again
    r.ban("a")
    assert r.choose(set(), 0.0).peer == "b"
    r.next_peers = []
    assert not r.has_next_stage and r.choose(set(), 0.0).peer is None


def test_an_accepted_send_feeds_the_balancer_and_records_the_hand_over() -> None:
    r = RouteCore()
    r.next_peers = ["a", "b"]
    r.sending("a")
    r.accepted((0, 0), "a", service_s=0.5, queue_len=3.0, now=1.0)
    r.sending("b")
    r.failed("b", 1.0)
    assert r.handed_to(0, "a") == [0] and r.handed_to(0, "b") == []
    assert r.balancer.expected_finish_s("a", 1.0) < r.balancer.expected_finish_s("b", 1.0)
    r.returned((0, 0), 3.0)  # a 2 s round trip: the deadline follows it
    assert r.deadline_s(cap_s=60.0) == 8.0


class _OldCopies:
    """The per-ticket bookkeeping as the router, the balancer and integrity kept it before one record
    owned it: the reference the record must agree with."""

    def __init__(self) -> None:
        self.routes: dict = {}
        self.tokens: dict = {}
        self.sent_to: dict = {}  # router: the peer that accepted the activation
        self.handed: dict = {}  # balancer: key -> (peer, at), insertion-ordered
        self.received: dict = {}  # integrity: (key, what) -> frame
        self.sent_fwd: dict = {}
        self.signed_to: dict = {}  # integrity: (key, direction) -> peer

    def prune(self, applied: int) -> None:
        self.routes = {k: v for k, v in self.routes.items() if k[0] >= applied}
        self.sent_to = {k: v for k, v in self.sent_to.items() if k[0] >= applied}
        self.tokens = {k: v for k, v in self.tokens.items() if k[0] >= applied}
        self.received = {k: v for k, v in self.received.items() if k[0][0] >= applied}
        self.sent_fwd = {k: v for k, v in self.sent_fwd.items() if k[0] >= applied}
        self.signed_to = {k: v for k, v in self.signed_to.items() if k[0][0] >= applied}


def test_the_record_answers_as_the_separate_copies_did_over_random_histories() -> None:
    for seed in range(60):
        rng = random.Random(seed)
        t, old = Tickets(), _OldCopies()
        applied, now = 0, 0.0
        peers = ["a", "b", "c"]
        for _ in range(300):
            now += rng.random()
            key = (applied + rng.randrange(2), rng.randrange(6))
            op = rng.randrange(9)
            peer = rng.choice(peers)
            if op == 0:
                route = [rng.choice(["s", "z"]), peer]
                t.hold(key, route)
                old.routes[key] = route
            elif op == 1:
                t.keep_tokens(key, now)
                old.tokens[key] = now
            elif op == 2:
                what = rng.choice(["input", "grad"])
                t.received(key, what, (what, now))
                old.received[(key, what)] = (what, now)
            elif op == 3:
                direction = rng.choice(["fwd", "bwd"])
                t.sent(key, direction, peer, (direction, now))
                old.signed_to[(key, direction)] = peer
                if direction == "fwd":
                    old.sent_fwd[key] = (direction, now)
            elif op == 4:
                t.handed(key, peer, now)
                old.sent_to[key] = peer
                old.handed.pop(key, None)
                old.handed[key] = (peer, now)
            elif op == 5:
                got = old.handed.pop(key, None)
                assert t.returned(key, now) == (None if got is None else (got[0], now - got[1]))
            elif op == 6:
                limit = rng.random() * 5
                want = [(k, p) for k, (p, at) in old.handed.items() if now - at > limit]
                for k, _ in want:
                    del old.handed[k]
                assert t.overdue(now, limit) == want
            elif op == 7:
                applied += 1
                t.prune(applied)
                old.prune(applied)
            else:
                t.forget_peer(peer)
                old.handed = {k: v for k, v in old.handed.items() if v[0] != peer}
            for k in [(s, i) for s in range(applied, applied + 2) for i in range(6)]:
                assert t.route(k) == old.routes.get(k) and t.tokens(k) == old.tokens.get(k)
                assert t.frame(k, "fwd") == old.sent_fwd.get(k)
                for what in ("input", "grad"):
                    assert t.frame(k, what) == old.received.get((k, what))
                for direction in ("fwd", "bwd"):
                    assert t.sent_to(k, direction) == old.signed_to.get((k, direction))
            for step in (applied, applied + 1):
                for p in peers:
                    assert t.handed_to(step, p) == sorted(i for (s, i), q in old.sent_to.items() if s == step and q == p)
