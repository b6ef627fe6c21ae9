"""The trio adapter of stage 0's :class:`~protolearn.node.core.leasing.LeaseCore`.

:meth:`TicketDriver.drive` runs while step t is open: it polls the core with the node's clock,
carries out its actions (a lease request, starting a ticket through the
:class:`~protolearn.node.router.Router`, releasing tickets, reporting a completion), feeds the answers
back as events, and sleeps until the core's next wake-up or until something happens (a completion, a
failed send, a departure). The node builds one driver with each stage it builds.

Liveness (issue 11): each pass also asks the routing core for microbatches handed to a stage-1 peer
whose gradient is overdue (:meth:`~protolearn.node.core.routing.RouteCore.overdue`); their tickets restart
on another peer at once (a :class:`PeerDown` for those tickets), and a peer that lost
its first one is reported to the coordinator (``liveness: ...`` with the count), then as
:mod:`protolearn.protocol.lost_reports` says (a report of fewer than three losses is a notice that charges
this node's late leases to their cause). One report is a claim: the coordinator bans only on a majority of
stage 0.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from protolearn.node.core.accounting import Accounting
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.core.events import Emit
from protolearn.node.core.leasing import (
    Completed,
    CompleteRefused,
    Handed,
    LeaseAction,
    LeaseCore,
    Leased,
    LeaseEvent,
    LeaseFailed,
    MemberLeft,
    NotStarted,
    PeerDown,
    Release,
    ReportComplete,
    RequestLease,
    StartTicket,
)
from protolearn.node.core.routing import RouteCore
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.node.progress import Progress
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.lost_reports import should_notice_departure, should_report
from protolearn.stages.config import RunConfig

log = logging.getLogger("protolearn.node")


# Runs ticket (step, ticket), leased with the nonce given, through this stage and sends it on; False if it
# could not be sent (the router's).
StartTicketFn = Callable[[int, int, bytes], Awaitable[bool]]


def emit(progress: Progress, action: Emit) -> None:
    """Write a core's :class:`Emit` to the event log, and to the log when it carries a level."""
    if action.level:
        log.log(action.level, "%s", action.message)
    progress.event(action.event, **action.fields)


class TicketDriver:
    """Leases and drives stage 0's tickets: :meth:`drive` once per open step."""

    def __init__(
        self, config: NodeConfig, run: RunConfig, link: CoordinatorLink, progress: Progress, *,
        accounting: Accounting, routes: RouteCore, start: StartTicketFn, outbound: Outbound = PASS_THROUGH,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """``accounting``: what this replica holds and has in flight; ``routes``: where its tickets went and
        which hand-overs are overdue; ``start``: runs a ticket through the stage (the router's
        :meth:`~protolearn.node.router.Router.start_ticket`); ``outbound``: for a step it withholds,
        leased tickets are never started."""
        self.config = config
        self.run = run
        self.link = link
        self.progress = progress
        self.clock = clock
        self.accounting = accounting
        self.routes = routes
        self.start = start
        self.outbound = outbound
        # A ticket whose gradient has not come back within this long is restarted (its route broke).
        self.core = LeaseCore(
            max_in_flight=config.max_in_flight, lease_block=config.lease_block,
            stall_s=config.request_timeout_s * run.stages.num_stages, last_stage=run.stages.num_stages == 1,
        )
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._reported_at: dict[str, tuple[float, int]] = {}  # peer -> (when, lost count) of its last liveness report
        # The open step's leases' nonces, by ticket (protocol/acks.py): the last stage signs its ack over one.
        self._nonces: dict[tuple[int, int], bytes] = {}

    # -- events from the node and the router --------------------------------------------------------
    def _feed(self, event: LeaseEvent) -> None:
        self._carry(self.core.handle(event, self.clock()))
        self._wake.set()

    def member_left(self) -> None:
        """A replica left or died: tickets routed through it will never get their gradient back."""
        self._feed(MemberLeft())

    def peer_down(self, peer: str, *, departed: bool = False) -> None:
        """A forward send to next-stage ``peer`` just failed (the router's ``on_peer_down``), or the
        connection to it closed, or it left the swarm (``departed``): the tickets sent to it will not come
        back. Stage 0 only (only it can restart a ticket). If it held some, the coordinator gets a notice
        (:mod:`protolearn.protocol.lost_reports`); a departed peer's routing statistics are forgotten, so
        losses from before it left never count against it if it rejoins."""
        tickets = self.routes.handed_to(self.core.step, peer)
        now = self.clock()
        if tickets and should_notice_departure(self._reported_at.get(peer), now) and self._nursery is not None:
            self._reported_at[peer] = (now, 0)
            why = f"liveness: it left or its connection closed holding {len(tickets)} microbatches it acknowledged"
            self._nursery.start_soon(self._report_peer, peer, why, 0)
        if departed:
            self.routes.forget(peer)
        self._feed(PeerDown(peer, tickets))

    async def complete(self, step: int, ticket: int, route: list[str], loss: float, ack: bytes | None = None, nonce: bytes = b"") -> None:
        """The router's ``on_complete``: ``ticket``'s gradient came back, so report it to the coordinator
        (awaited here, so a completion that lands after the step's drive ended is still reported)."""
        actions = self.core.handle(Completed(step, ticket, route, loss, ack, nonce), self.clock())
        self._wake.set()
        for a in actions:
            if isinstance(a, ReportComplete):
                await self._report(a)
            else:
                self._carry([a])

    # -- the loop ------------------------------------------------------------------------------------
    async def drive(self, step: int, closed: trio.Event) -> None:
        """Lease tickets of ``step`` and start them, at most ``max_in_flight`` at once, until it closes."""
        core = self.core
        core.begin(step, [t for t in core.started if self.accounting.holds(step, t)], self.clock())
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                while not closed.is_set():
                    now = self.clock()
                    self._check_overdue(step, now)
                    self._carry(core.poll(now, in_flight=self.accounting.num_in_flight, has_next_stage=self.routes.has_next_stage))
                    self._wake = trio.Event()
                    with trio.move_on_at(core.next_wake(now)):
                        await _first(closed, self._wake)
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    def _check_overdue(self, step: int, now: float) -> None:
        """Restart the tickets whose gradient is overdue from a stage-1 peer; report a peer that keeps losing them."""
        lost = self.routes.overdue(now, self.core.stall_s)
        by_peer: dict[str, list[int]] = {}
        for (s, t), peer in lost:
            if s == step:
                by_peer.setdefault(peer, []).append(t)
        for peer, tickets in sorted(by_peer.items()):
            log.warning("gradients overdue peer=%s step=%d tickets=%s: restarting them elsewhere", peer, step, tickets)
            self._carry(self.core.handle(PeerDown(peer, tickets), now))
        for peer in sorted({p for _, p in lost}):
            n = self.routes.lost(peer)
            if should_report(n, self._reported_at.get(peer), now) and self._nursery is not None:
                self._reported_at[peer] = (now, n)
                why = f"liveness: {n} microbatches it acknowledged got no gradient back within {self.routes.deadline_s(self.core.stall_s):.1f} s"
                self._nursery.start_soon(self._report_peer, peer, why, n)

    async def _report_peer(self, peer: str, why: str, lost: int) -> None:
        try:
            reply = await self.link.report(peer, why, lost=lost)
        except ProtocolError as err:
            log.info("liveness report failed peer=%s reason=%s", peer, err.reason)
            return
        emit(self.progress, Emit("peer_reported", {"peer": peer, "reason": why, "banned": reply.banned}, logging.WARNING,
                                 f"reported peer={peer} banned={reply.banned} reason={why} verdict={reply.reason}"))

    def _carry(self, actions: list[LeaseAction]) -> None:
        for a in actions:
            if isinstance(a, Emit):
                emit(self.progress, a)
            elif self._nursery is None:
                # Between steps nothing is leased or started: the next drive restarts what is still held.
                log.warning("ticket action outside a driven step dropped: %s (step %d)", type(a).__name__, getattr(a, "step", -1))
            elif isinstance(a, RequestLease):
                self._nursery.start_soon(self._lease, a)
            elif isinstance(a, StartTicket):
                self._nursery.start_soon(self._run_ticket, a.step, a.ticket)
            elif isinstance(a, Release):
                self._nursery.start_soon(self._release, a.step, a.tickets)
            elif isinstance(a, ReportComplete):
                self._nursery.start_soon(self._report, a)

    async def _lease(self, a: RequestLease) -> None:
        try:
            reply = await self.link.lease(a.max_tickets, wait_s=a.wait_s, holding=list(a.holding))
        except ProtocolError as err:
            self._feed(LeaseFailed(err.reason))
            return
        if any(s != reply.step for s, _ in self._nonces):
            self._nonces = {k: v for k, v in self._nonces.items() if k[0] == reply.step}
        self._nonces.update(((reply.step, i), n) for i, n in zip([*reply.indices, *reply.held], [*reply.nonces, *reply.held_nonces]))
        self.routes.avoid(reply.step, list(reply.avoid))
        self.routes.suspect(list(reply.suspects))
        self._feed(Leased(reply.step, list(reply.indices), waited=reply.waited_s > 0, held=tuple(reply.held), reason=reply.reason))

    async def _run_ticket(self, step: int, ticket: int) -> None:
        if self.outbound.withholds(step):
            return  # it sits on its lease
        if await self.start(step, ticket, self._nonces.get((step, ticket), b"")):
            self._feed(Handed(step, ticket))
        else:
            self._feed(NotStarted(step, ticket))

    async def _release(self, step: int, indices: list[int]) -> None:
        try:
            await self.link.release(step, indices)
        except ProtocolError as err:
            log.info("release failed step=%d tickets=%s reason=%s", step, indices, err.reason)

    async def _report(self, a: ReportComplete) -> None:
        try:
            await self.link.complete(a.step, a.ticket, a.route, a.loss, a.ack, a.nonce)
        except ProtocolError as err:
            code = err.code if isinstance(err, CoordinatorRefused) else "unreachable"
            for b in self.core.handle(CompleteRefused(a.step, a.ticket, code, err.reason), self.clock()):
                if isinstance(b, Release):
                    await self._release(b.step, b.tickets)
                else:
                    self._carry([b])


async def _first(*events: trio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        async def one(e: trio.Event) -> None:
            await e.wait()
            nursery.cancel_scope.cancel()

        for e in events:
            nursery.start_soon(one, e)
