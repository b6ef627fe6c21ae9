"""Issue 11, liveness faults: nodes that accept work and never deliver are expelled; slow ones are not.

Sans-IO: a real :class:`CoordinatorCore` driven with a fake clock by a tiny swarm loop (every tick the
coordinator does its housekeeping and each stage-0 replica acts its part), as in
``test_attacks_ledger.py``; and the verdict policy for reports of lost microbatches on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal
from protolearn.node.core.routing import RouteCore
from protolearn.protocol import coordination as cm

from tests.support.coordinator import make_core
from tests.unit.test_attacks_ledger import B, RUN, SETTINGS, Swarm

TICK = SETTINGS.housekeeping_interval_s
LATE_S = SETTINGS.lease_late_fraction * SETTINGS.lease_s


@dataclass
class Part:
    """How one stage-0 replica behaves: ``delay`` after its lease it completes a ticket (None: never)."""

    delay: float | None = 0.0
    leased: int = 0
    held: dict[tuple[int, int], float] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)


def run(
    core: CoordinatorCore, swarm: Swarm, parts: dict[str, Part], *, until: float, hook: Callable[[float], None] | None = None,
) -> list[tuple[int, float]]:
    """Tick the swarm until ``until`` (``hook(now)`` first each tick); returns (step, closed_at) of every step that closed."""
    closed: list[tuple[int, float]] = []
    s1 = swarm.stages[1]
    t = 0.0
    while t < until:
        t += TICK
        core.housekeeping(t)
        if hook is not None:
            hook(t)
        for peer, part in parts.items():
            if core.verdicts.is_banned(peer):
                continue
            step = core.ledger.step
            got = core.handle(peer, cm.Lease(max_tickets=4), t).indices
            part.leased += len(got)
            part.held.update({(step, i): t for i in got})
            if part.delay is None:
                continue
            for (st, i), at in sorted(part.held.items()):
                if t - at >= part.delay:
                    del part.held[(st, i)]
                    try:
                        swarm.complete(peer, st, i, [peer, s1[i % len(s1)]], 3.0, t)
                    except Refusal as err:
                        part.refused.append(err.code)
            if core.ledger.step != step:
                closed.append((step, t))
                for stage, peers in swarm.stages.items():
                    for p in peers:
                        if not core.verdicts.is_banned(p):
                            swarm.averaged(p, step, f"h{stage}", t)
    return closed


def test_a_stage0_blackhole_is_expelled_within_20_leases_and_steps_then_close_at_the_honest_pace() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=3)
    hole, *honest = swarm.stages[0]
    parts = {p: Part() for p in honest} | {hole: Part(delay=None)}
    closed = run(core, swarm, parts, until=60.0)

    ban = core.verdicts.bans.get(hole)
    assert ban is not None and ban.reason.startswith("liveness: held "), core.verdicts.bans
    assert f"past {LATE_S:g} s without completing any" in ban.reason
    assert parts[hole].leased <= 20, parts[hole].leased
    assert not any(core.verdicts.is_banned(p) for p in honest)
    # Visible in swarm status before the ban: its late-lease strikes.
    (flag,) = core.verdicts.flags_of(hole)
    assert flag.startswith("late_leases:") and int(flag.split(":")[1]) >= SETTINGS.expel_after_strikes
    # Each strike ends its leases at once, so the ban comes about one late window per strike.
    assert ban.at <= SETTINGS.expel_after_strikes * (LATE_S + 2 * TICK) + 1.0, ban.at
    after = [at for _, at in closed if at > ban.at]
    # With the blackhole gone, a step closes every tick (the honest pace of this loop).
    assert len(after) >= 0.9 * (60.0 - ban.at) / TICK - 2, (len(after), ban.at)


def test_a_slow_honest_replica_is_never_expelled_even_when_its_tickets_go_to_others() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=3)
    slow, *honest = swarm.stages[0]
    # It completes every ticket at 1.5 late windows: always late, struck, its leases ended early and
    # re-issued; its completions are then refused (not the leaseholder) but prove it works.
    parts = {p: Part() for p in honest} | {slow: Part(delay=1.5 * LATE_S)}
    run(core, swarm, parts, until=120.0)
    assert core.verdicts.bans == {}
    assert core.verdicts.flags_of(slow)  # flagged, share shrunk
    assert parts[slow].refused and set(parts[slow].refused) <= {"not_leaseholder", "duplicate", "step_closed"}


def test_a_slow_replica_that_completes_its_own_late_leases_is_never_expelled() -> None:
    core = make_core(RUN, CoordinatorSettings(**(SETTINGS.model_dump() | {"expel_after_strikes": 2})))
    swarm = Swarm(core, per_stage=2)
    slow, honest = swarm.stages[0]
    parts = {honest: Part(), slow: Part(delay=LATE_S + 1.0)}
    run(core, swarm, parts, until=120.0)
    assert core.verdicts.bans == {}


def test_fake_late_completions_of_tickets_it_never_held_do_not_save_a_blackhole() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=3)
    hole, *honest = swarm.stages[0]
    s1 = swarm.stages[1][0]

    def claim_others_work(t: float) -> None:
        """It claims tickets other replicas completed: refused, and nothing shows it ever worked on them."""
        if core.verdicts.is_banned(hole):
            return
        for i, tk in enumerate(core.ledger.tickets):
            if tk.done and tk.holder != hole:
                try:
                    swarm.complete(hole, core.ledger.step, i, [hole, s1], 3.0, t)
                except Refusal:
                    pass

    run(core, swarm, {p: Part() for p in honest} | {hole: Part(delay=None)}, until=60.0, hook=claim_others_work)
    assert core.verdicts.is_banned(hole) and core.verdicts.bans[hole].reason.startswith("liveness: held ")


def test_no_stage0_replica_is_expelled_when_none_completes_anything() -> None:
    """Every stage-0 replica sits: the fault is further down (a dead or blackholed stage 1), not theirs."""
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    parts = {p: Part(delay=None) for p in swarm.stages[0]}
    run(core, swarm, parts, until=60.0)
    assert core.verdicts.bans == {}
    assert all(core.verdicts.flags_of(p) for p in swarm.stages[0])


def test_expel_after_strikes_none_only_flags() -> None:
    core = make_core(RUN, CoordinatorSettings(**(SETTINGS.model_dump() | {"expel_after_strikes": None})))
    swarm = Swarm(core, per_stage=3)
    hole, *honest = swarm.stages[0]
    run(core, swarm, {p: Part() for p in honest} | {hole: Part(delay=None)}, until=40.0)
    assert core.verdicts.bans == {} and core.verdicts.flags_of(hole)


# -- reports of lost microbatches against later stages ----------------------------------------------------
def _policy(**kw: object) -> VerdictPolicy:
    return VerdictPolicy(CoordinatorSettings(**kw))


def test_one_reporter_only_flags_a_later_stage_peer() -> None:
    v = _policy()
    d = v.liveness_report("a", "x", "liveness: 3 lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    assert not d.ban and "1 of the 2" in d.reason
    assert v.flags_of("x") == ["lost_microbatches:1"]
    d = v.liveness_report("a", "x", "liveness: 3 lost", target_stage=1, upstream=["a", "b"], now=2.0, lost=3)
    assert not d.ban  # the same reporter twice is still one


def test_two_upstream_reporters_that_are_a_majority_ban() -> None:
    v = _policy()
    v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b", "c"], now=1.0, lost=3)
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b", "c"], now=2.0, lost=3)
    assert d.ban and v.bans["x"].reason.startswith("liveness: 2 of 3 live stage-0 replicas")


def test_reporters_outside_the_upstream_stage_or_a_minority_do_not_ban() -> None:
    v = _policy()
    up = ["a", "b", "c", "d"]
    for r in ("a", "b", "sybil1", "sybil2"):  # sybils are not live replicas of the stage before
        d = v.liveness_report(r, "x", "liveness: lost", target_stage=1, upstream=up, now=1.0, lost=3)
    assert not d.ban and "2 of the 4" in d.reason  # 2 of 4 is no strict majority
    d = v.liveness_report("c", "x", "liveness: lost", target_stage=1, upstream=up, now=2.0, lost=3)
    assert d.ban


def test_reports_against_a_peer_the_coordinator_has_not_heard_from_either_only_flag() -> None:
    """A frozen peer (a suspended laptop) is silent to everyone: its membership expires; only a peer that
    keeps heartbeating while it drops work (a blackhole) is banned on its upstream's reports."""
    v = _policy(heartbeat_interval_s=1.0)
    v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, heard_s_ago=2.5, lost=3)
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=2.0, heard_s_ago=3.5, lost=3)
    assert not d.ban and "has not heartbeated for 3.5 s" in d.reason
    # Heard again: the reports made while it was silent do not count, fresh ones do.
    d = v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=3.0, heard_s_ago=0.4, lost=3)
    assert not d.ban and "1 of the 2" in d.reason
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=4.0, heard_s_ago=0.4, lost=3)
    assert d.ban  # still its microbatches never come back


def test_reports_expire_after_the_window() -> None:
    v = _policy(report_window_s=10.0)
    v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=0.0, lost=3)
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=20.0, lost=3)
    assert not d.ban


def test_a_peer_that_itself_lost_microbatches_downstream_is_only_flagged() -> None:
    """In a 3-stage run a stage-2 blackhole starves stage 1 too; stage 0 then blames the stage-1 victim."""
    v = _policy()
    v.liveness_report("x", "z", "liveness: lost", target_stage=2, upstream=["x"], now=0.5, lost=3)  # x blames z
    v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    assert not d.ban and "victim" in d.reason


def test_the_only_serving_replica_of_a_stage_is_flagged_not_banned() -> None:
    v = _policy()
    for r in ("a", "b"):
        d = v.liveness_report(r, "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, replicas=1, lost=3)
    assert not d.ban and "only serving replica" in d.reason


def test_stage0_targets_and_a_disabled_policy_never_ban() -> None:
    v = _policy()
    for r in ("a", "b", "c"):
        d = v.liveness_report(r, "x", "liveness: lost", target_stage=0, upstream=[], now=1.0, lost=3)
    assert not d.ban
    v = _policy(expel_on_liveness_reports=False)
    for r in ("a", "b"):
        d = v.liveness_report(r, "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    assert not d.ban and v.flags_of("x") == ["lost_microbatches:2"]


def test_reports_never_ban_a_peer_whose_tickets_complete_after_they_began() -> None:
    """Issue 27: once a liar was banned, an honest stage-1 replica carried its load, lost a few microbatches
    to 2 s timeouts under it, and both stage-0 replicas' reports banned it. The coordinator saw its tickets
    complete (their routes signed by the last stage): reports never ban alone."""
    v = _policy()
    v.liveness_report("a", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    v.completed(["a", "x"], 1.5)  # a ticket through x completed after the first report
    d = v.liveness_report("b", "x", "liveness: lost", target_stage=1, upstream=["a", "b"], now=2.0, lost=3)
    assert not d.ban and "carried a ticket to completion" in d.reason
    assert v.flags_of("x") == ["lost_microbatches:2"]
    # A peer that carried work only before the reports began is a blackhole now: the reports stand.
    v.completed(["a", "w"], 0.5)
    v.liveness_report("a", "w", "liveness: lost", target_stage=1, upstream=["a", "b"], now=1.0, lost=3)
    assert v.liveness_report("b", "w", "liveness: lost", target_stage=1, upstream=["a", "b"], now=2.0, lost=3).ban


def test_the_core_routes_liveness_reports_to_the_stage_majority_rule() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    a, b = swarm.stages[0]
    x, y = swarm.stages[1]
    r = core.handle(a, cm.Report(target=x, reason="liveness: 4 microbatches got no gradient back", lost=4), 1.0)
    assert isinstance(r, cm.ReportReply) and not r.banned
    r = core.handle(y, cm.Report(target=x, reason="liveness: 4 microbatches got no gradient back", lost=4), 1.0)
    assert not r.banned  # y is x's fellow replica, not upstream
    r = core.handle(b, cm.Report(target=x, reason="liveness: 4 microbatches got no gradient back", lost=4), 1.0)
    assert r.banned and core.verdicts.is_banned(x) and not core.registry.is_live(x)
    # A plain report (any other reason) still never bans.
    for p in (a, b):
        r = core.handle(p, cm.Report(target=y, reason="it looks slow"), 2.0)
    assert not r.banned


# -- the node's routing core: microbatches acknowledged and never answered --------------------------------
def test_the_routing_core_gives_up_on_unanswered_microbatches_and_stops_choosing_their_peer() -> None:
    r = RouteCore()
    b, handed = r.balancer, r.tickets.handed
    # Honest round trips of about 0.3 s set the deadline to 4x that, but at least 2 s.
    for i in range(4):
        handed((0, i), "good", 0.0)
        r.returned((0, i), 0.3)
    assert r.deadline_s(cap_s=60.0) == 2.0
    handed((1, 0), "hole", 1.0)
    handed((1, 1), "good", 1.0)
    assert r.overdue(2.5, cap_s=60.0) == []
    r.returned((1, 1), 1.4)
    assert r.overdue(3.5, cap_s=60.0) == [((1, 0), "hole")]
    assert r.lost("hole") == 1 and r.lost("good") == 0
    assert b.choose(["good", "hole"], 3.5).peer == "good"
    # Losses in a row double the penalty; one returned microbatch resets the count.
    for i in range(2, 5):
        handed((1, i), "hole", 4.0)
    assert len(r.overdue(10.0, cap_s=60.0)) == 3 and r.lost("hole") == 4
    assert b.expected_finish_s("hole", 10.0) > 8 * b.failure_penalty_s
    handed((2, 0), "hole", 10.0)
    r.returned((2, 0), 10.1)
    assert r.lost("hole") == 0


def test_the_overdue_deadline_follows_slow_round_trips_and_is_capped() -> None:
    r = RouteCore()
    assert r.deadline_s(cap_s=7.0) == 7.0  # nothing measured yet: the caller's cap
    r.tickets.handed((0, 0), "p", 0.0)
    r.returned((0, 0), 5.0)  # a slow (loaded) round trip raises the deadline at once
    assert r.deadline_s(cap_s=60.0) == 20.0 and r.deadline_s(cap_s=7.0) == 7.0
    r.tickets.handed((0, 1), "p", 5.0)
    assert r.overdue(20.0, cap_s=60.0) == []
    r.forget("p")
    assert r.overdue(1e9, cap_s=60.0) == []


def test_stage0_restarts_overdue_tickets_elsewhere_and_reports_a_peer_that_keeps_losing_them() -> None:
    """The driver's liveness pass (node/driver.py) with the real lease core and routing core and a fake link."""
    from types import SimpleNamespace

    import trio
    from protolearn.node.core import leasing as lc
    from protolearn.node.core.accounting import Accounting
    from protolearn.protocol.lost_reports import REPORT_AFTER_LOST
    from protolearn.node.driver import TicketDriver

    reports: list[tuple[str, str]] = []

    class Link:
        async def report(self, target: str, reason: str, *, lost: int = 0) -> cm.ReportReply:
            assert reason.startswith(f"liveness: {lost} microbatches")
            reports.append((target, reason))
            return cm.ReportReply(banned=False, reason="flagged")

    class Progress:
        def event(self, *a: object, **kw: object) -> None: ...

    config = SimpleNamespace(max_in_flight=8, lease_block=4, request_timeout_s=30.0)
    run_ = SimpleNamespace(stages=SimpleNamespace(num_stages=2))
    now = [0.0]
    routes = RouteCore()

    async def start(step: int, ticket: int, nonce: bytes) -> bool:
        raise AssertionError("the liveness pass starts nothing itself")

    d = TicketDriver(config, run_, Link(), Progress(), accounting=Accounting(4, 8, 2), routes=routes, start=start,  # type: ignore[arg-type]
                     clock=lambda: now[0])
    d.core.begin(5, [], 0.0)
    d.core.handle(lc.Leased(5, [0, 1, 2, 3]), 0.0)
    for t in range(4):
        routes.tickets.handed((5, t), "hole" if t < REPORT_AFTER_LOST else "good", 0.0)
        d.core.handle(lc.Handed(5, t), 0.0)  # each attempt was sent on: a next-stage replica took it
    routes.returned((5, 3), 0.5)  # the good peer answers: round trips of 0.5 s

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            d._nursery = nursery
            now[0] = 3.0  # past the 2 s floor, well before stall_s (60 s) and any lease expiry
            d._check_overdue(5, now[0])
            restarted = [a.ticket for a in d.core.poll(now[0], in_flight=0, has_next_stage=True) if isinstance(a, lc.StartTicket)]
            assert restarted == [0, 1, 2]
            d._nursery = None

    trio.run(main)
    assert [t for t, _ in reports] == ["hole"] and reports[0][1].startswith("liveness: 3 microbatches")
    assert routes.balancer.choose(["good", "hole"], 3.0).peer == "good"


def test_a_holder_whose_tickets_a_silent_downstream_peer_sat_on_is_not_struck_but_a_false_blame_excuses_nothing() -> None:
    """Costs go to their cause (issue 27, rule 5): a stage-0 replica that completes nothing because the stage-1
    peer its tickets went to never answers, and that reported it, takes no late-lease strike while the
    coordinator's own record agrees (nothing routed through that peer completed since the report). Blaming
    a peer that does carry tickets to completion excuses nothing."""

    def late_strikes(blamed: int) -> list[str]:
        core = make_core(RUN, SETTINGS)
        swarm = Swarm(core, per_stage=2)
        victim, other = swarm.stages[0]
        silent, carrier = swarm.stages[1]
        swarm.stages[1] = [carrier]  # every completed ticket goes through the carrier; the silent peer carries none
        target = (silent, carrier)[blamed]

        def blame(t: float) -> None:
            if t == TICK:  # before anything completed
                core.handle(victim, cm.Report(target=target, reason="liveness: 3 microbatches it acknowledged got no gradient back", lost=3), t)

        run(core, swarm, {victim: Part(delay=None), other: Part()}, until=2.5 * LATE_S, hook=blame)
        assert core.verdicts.flags_of(target) == ["lost_microbatches:1"]
        return [f for f in core.verdicts.flags_of(victim) if f.startswith("late_leases")]

    assert late_strikes(blamed=0) == []
    assert late_strikes(blamed=1) != []


def test_a_report_of_fewer_than_three_losses_is_a_notice_that_neither_flags_nor_counts_toward_a_ban() -> None:
    """A stage-0 replica tells the coordinator of its first lost microbatch (so that its own late leases are
    charged to the peer that sat on them), but only reports of three in a row flag the target and count."""
    v = _policy()
    for r in ("a", "b"):
        d = v.liveness_report(r, "x", "liveness: 1 microbatches", target_stage=1, upstream=["a", "b", "c"], now=1.0, lost=1)
        assert not d.ban and d.reason.startswith("noted")
    assert v.flags_of("x") == [] and "x" not in v.liveness and set(v.notices["x"]) == {"a", "b"}
    v.liveness_report("a", "x", "liveness: 3 microbatches", target_stage=1, upstream=["a", "b", "c"], now=2.0, lost=3)
    d = v.liveness_report("b", "x", "liveness: 3 microbatches", target_stage=1, upstream=["a", "b", "c"], now=2.0, lost=3)
    assert d.ban


def test_the_first_lost_microbatch_is_reported_and_reaching_three_is_reported_at_once() -> None:
    from protolearn.protocol.lost_reports import REPORT_AFTER_LOST, REPORT_INTERVAL_S, should_report

    assert not should_report(0, None, 0.0)
    assert should_report(1, None, 0.0)
    assert not should_report(2, (0.0, 1), 1.0), "within the interval a second loss is not reported again"
    assert should_report(REPORT_AFTER_LOST, (0.0, 2), 1.0), "reaching the count that bans is reported at once"
    assert not should_report(REPORT_AFTER_LOST + 1, (1.0, REPORT_AFTER_LOST), 2.0)
    assert should_report(REPORT_AFTER_LOST + 1, (1.0, REPORT_AFTER_LOST), 1.0 + REPORT_INTERVAL_S)


def test_a_holder_that_noticed_its_first_lost_microbatch_is_not_struck_for_late_leases() -> None:
    """Costs go to their cause (issue 27, rule 5): a stage-0 replica whose tickets a downstream withholder sat
    on had lost two microbatches when its lease turned late; it told the coordinator at the first one, so
    it is not struck (adversary simulator, withhold, seed 38: struck before its report of three)."""
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    victim, other = swarm.stages[0]
    silent, carrier = swarm.stages[1]
    swarm.stages[1] = [carrier]

    def notice(t: float) -> None:
        if t == TICK:
            core.handle(victim, cm.Report(target=silent, reason="liveness: 1 microbatches it acknowledged got no gradient back", lost=1), t)

    run(core, swarm, {victim: Part(delay=None), other: Part()}, until=2.5 * LATE_S, hook=notice)
    assert core.verdicts.flags_of(silent) == [], "a notice flags nobody"
    assert [f for f in core.verdicts.flags_of(victim) if f.startswith("late_leases")] == []


def test_a_peer_that_leaves_holding_handed_microbatches_gets_a_notice_and_its_losses_are_forgotten() -> None:
    """A next-stage peer that leaves and rejoins would launder its losses (the router forgets a departed peer);
    so its departure with handed microbatches is a notice (``lost`` 0), which names it as the cause of the
    holder's late leases and never flags or bans it."""
    from types import SimpleNamespace

    import trio
    from protolearn.node.core import leasing as lc
    from protolearn.node.core.accounting import Accounting
    from protolearn.node.driver import TicketDriver

    reports: list[tuple[str, int]] = []

    class Link:
        async def report(self, target: str, reason: str, *, lost: int = 0) -> cm.ReportReply:
            reports.append((target, lost))
            return cm.ReportReply(banned=False, reason="noted")

    class Progress:
        def event(self, *a: object, **kw: object) -> None: ...

    routes = RouteCore()

    async def start(step: int, ticket: int, nonce: bytes) -> bool:
        return True

    d = TicketDriver(SimpleNamespace(max_in_flight=8, lease_block=4, request_timeout_s=30.0),  # type: ignore[arg-type]
                     SimpleNamespace(stages=SimpleNamespace(num_stages=2)), Link(), Progress(),  # type: ignore[arg-type]
                     accounting=Accounting(4, 8, 2), routes=routes, start=start, clock=lambda: 1.0)
    d.core.begin(5, [], 0.0)
    d.core.handle(lc.Leased(5, [0, 1]), 0.0)
    for t in (0, 1):
        routes.tickets.handed((5, t), "gone", 0.0)
        d.core.handle(lc.Handed(5, t), 0.0)
    routes.balancer.on_lost("gone", 0.5)
    assert routes.lost("gone") == 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            d._nursery = nursery
            d.peer_down("gone", departed=True)
            d.peer_down("gone", departed=True)  # a second view change within the interval: one notice
        d._nursery = None

    trio.run(main)
    assert reports == [("gone", 0)]
    assert routes.lost("gone") == 0, "its losses before it left are forgotten"
    assert routes.overdue(100.0, 1.0) == [], "nothing is awaited from it any more"


def test_a_reported_peer_is_a_suspect_with_a_lower_share_until_it_carries_a_ticket() -> None:
    """Liveness reports lower the accused's routing share (issue 27, rule 5), never to nothing, and a
    completion through it (the coordinator's own record) clears it."""
    from protolearn.node.core.balancer import SUSPECT_FACTOR, Balancer

    v = _policy()
    v.liveness_report("a", "x", "liveness: 3 lost", target_stage=1, upstream=["a", "b", "c"], now=1.0, lost=3)
    v.liveness_report("a", "y", "liveness: 1 lost", target_stage=1, upstream=["a", "b", "c"], now=1.0, lost=1)
    assert v.suspects(lambda p: True, 2.0) == ["x"], "a notice makes no suspect"
    assert v.suspects(lambda p: p != "x", 2.0) == []
    v.completed(["s0", "x"], 3.0)
    assert v.suspects(lambda p: True, 4.0) == []
    b = Balancer()
    b.on_done("x", 0.1)
    b.on_done("z", 0.1)
    b.suspects = frozenset({"x"})
    assert b.expected_finish_s("x", 0.0) == SUSPECT_FACTOR * b.expected_finish_s("z", 0.0)
    assert b.choose(["x", "z"], 0.0).peer == "z"
    assert b.choose(["x", "z"], 0.0, {"z": 3}).peer == "x", "a suspect still gets work when the others are busier"


def test_a_hung_replica_that_keeps_asking_is_not_handed_back_the_tickets_its_strike_took() -> None:
    """A hung stage-0 node's event loop still asks for leases (its compute thread is what hangs). It asks
    first each tick here: a strike ends its leases, and they must go to the replica that works, not straight
    back to it (it was, and the step waited on it until its ban). A lone replica takes its own back at once."""
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    hole, honest = swarm.stages[0]
    parts = {hole: Part(delay=None), honest: Part()}  # (the hole asks first)
    closed = run(core, swarm, parts, until=3 * LATE_S)
    # The first step waits for the hole's first strike (one late window), then the honest replica does its tickets.
    assert closed and closed[0][1] <= LATE_S + 3 * TICK, (closed[:2], LATE_S)
    assert not core.verdicts.is_banned(hole) or core.verdicts.bans[hole].at > closed[0][1]

    lone = make_core(RUN, SETTINGS)
    (only,) = Swarm(lone, per_stage=1).stages[0]
    got = lone.handle(only, cm.Lease(max_tickets=B), 0.0).indices
    assert got
    t = SETTINGS.lease_s + TICK
    lone.housekeeping(t)  # its leases ran out; nobody else could take them
    assert lone.handle(only, cm.Lease(max_tickets=B), t).indices == got
