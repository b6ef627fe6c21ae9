"""Stage 0's tickets in the simulation: what :class:`~protolearn.node.driver.TicketDriver` does around the real
:class:`~protolearn.node.core.leasing.LeaseCore`.

Each stage-0 node drives the open step while its train loop waits for it to close: it polls its lease
core when something happens or when the core asks to be woken (:meth:`LeaseCore.next_wake`), restarts
the tickets whose gradient is overdue from a stage-1 peer (:meth:`RouteCore.overdue`, capped at the
core's ``stall_s``), and carries the core's actions out against the real coordinator core: lease
requests (whose reply also carries the step's sit-outs and suspects for the router), ticket starts
(:mod:`.pipeline`), releases, and completions with the last stage's signed ack. A forward send that
fails and a departed next-stage peer become :class:`PeerDown` events (the tickets handed to that peer),
a departed later-stage member a :class:`MemberLeft` (node/node.py's ``_departed``); a lost microbatch
or a departure holding some is reported to the coordinator when :mod:`protolearn.protocol.lost_reports`
says so. Requests take the node's round trip to the coordinator; while the coordinator is down they fail
as the real link's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protolearn.coordinator.errors import Refusal
from protolearn.node.core import leasing as lc
from protolearn.node.core.events import Emit
from protolearn.protocol import coordination as cm
from protolearn.protocol.lost_reports import should_notice_departure, should_report
from protolearn.sim.coordinator_host import Unavailable
from protolearn.sim.world import SimNode, World

COMPLETE_RETRY_S = 1.0  # the link retries a completion the coordinator could not take
MIN_WAKE_S = 1e-3


class LeaseDriver:
    """Drives every stage-0 node's lease core (one :meth:`begin` per open step, then events)."""

    def __init__(self, world: World, start: Callable[[SimNode, int, int], bool]) -> None:
        """``start(node, step, ticket)``: run a ticket through stage 0 (the pipeline); False if it did not start."""
        self.w = world
        self.start = start

    def _rtt(self, node: SimNode) -> float:
        return 2.0 * node.wire.delay_s

    # -- the loop ------------------------------------------------------------------------------------
    def begin(self, node: SimNode, step: int) -> None:
        """The node's train loop waits for ``step`` to close: drive its tickets."""
        lease, core = node.lease, node.core
        if lease is None or core is None:
            return
        lease.begin(step, [t for t in lease.started if core.accounting.holds(step, t)], self.w.now)
        self.poke(node)

    def poke(self, node: SimNode) -> None:
        """Something happened: poll now."""
        node.wake_token += 1
        self.w.engine.after(0.0, self._poll, node, node.wake_token)

    def _driving(self, node: SimNode) -> int | None:
        if not node.alive or node.silent or node.lease is None or node.waiting is None or node.finishing:
            return None
        return node.waiting[0]

    def _poll(self, node: SimNode, token: int) -> None:
        if token != node.wake_token:
            return
        step = self._driving(node)
        if step is None:
            return
        lease, core = node.lease, node.core
        assert lease is not None and core is not None
        now = self.w.now
        self._check_overdue(node, step, now)
        self._carry(node, lease.poll(now, in_flight=core.accounting.num_in_flight, has_next_stage=self._has_next(node)))
        node.wake_token += 1
        # The core may ask to be woken at now (a deadline that falls due exactly then): a real clock has moved on
        # by the next poll, a fake one must be told to.
        self.w.engine.at(max(lease.next_wake(now), now + MIN_WAKE_S), self._poll, node, node.wake_token)

    def _has_next(self, node: SimNode) -> bool:
        return self.w.num_stages == 1 or bool(self.w.serving[1])

    def _check_overdue(self, node: SimNode, step: int, now: float) -> None:
        assert node.lease is not None
        lost = node.routes.overdue(now, node.lease.stall_s)
        by_peer: dict[str, list[int]] = {}
        for (s, t), peer in lost:
            if s == step:
                by_peer.setdefault(peer, []).append(t)
        for peer, tickets in sorted(by_peer.items()):
            self.w.metrics.events["gradients_overdue"] += len(tickets)
            self._carry(node, node.lease.handle(lc.PeerDown(peer, tickets), now))
        for peer in sorted({p for _, p in lost}):
            n = node.routes.lost(peer)
            if should_report(n, node.reported_at.get(peer), now):
                node.reported_at[peer] = (now, n)
                self._report(node, peer, f"liveness: {n} microbatches it acknowledged got no gradient back", n)

    # -- events from the pipeline and the membership -------------------------------------------------
    def feed(self, node: SimNode, event: Any) -> None:
        if node.lease is None or not node.alive or node.silent:
            return
        self._carry(node, node.lease.handle(event, self.w.now))
        self.poke(node)

    def peer_down(self, node: SimNode, peer: str, *, departed: bool = False) -> None:
        """node/driver.py's ``peer_down``: a send to stage-1 ``peer`` failed, or it left (``departed``)."""
        if node.lease is None or not node.alive:
            return
        tickets = node.routes.handed_to(node.lease.step, peer)
        now = self.w.now
        if tickets and should_notice_departure(node.reported_at.get(peer), now):
            node.reported_at[peer] = (now, 0)
            self._report(node, peer, f"liveness: it left or its connection closed holding {len(tickets)} microbatches it acknowledged", 0)
        if departed:
            node.routes.forget(peer)
        self.feed(node, lc.PeerDown(peer, tickets))

    def member_left(self, node: SimNode) -> None:
        self.w.metrics.events["member_left_restarts"] += 1
        self.feed(node, lc.MemberLeft())

    # -- the lease core's actions ----------------------------------------------------------------------
    def _carry(self, node: SimNode, actions: list[lc.LeaseAction]) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self.w.metrics.events[a.event] += 1
            elif isinstance(a, lc.RequestLease):
                self.w.engine.after(self._rtt(node), self._lease, node, a, node.epoch)
            elif isinstance(a, lc.StartTicket):
                if not self.start(node, a.step, a.ticket):
                    assert node.core is not None
                    node.core.accounting.dropped(a.step, a.ticket)
                    self._carry(node, node.lease.handle(lc.NotStarted(a.step, a.ticket), self.w.now))  # type: ignore[union-attr]
            elif isinstance(a, lc.Release):
                self.w.engine.after(self._rtt(node), self._release, node, a.step, list(a.tickets))
            elif isinstance(a, lc.ReportComplete):
                self.w.engine.after(self._rtt(node), self._complete, node, a, node.epoch)

    def _lease(self, node: SimNode, a: lc.RequestLease, epoch: int) -> None:
        if not node.alive or node.silent or node.lease is None or epoch != node.epoch:
            return
        try:
            # The coordinator core answers at once here: the real service's held request (``Lease.wait_s``) is not
            # modelled, so a freed ticket waits for the asker's back-off in the simulator.
            reply = self.w.host.request(node.peer, cm.Lease(max_tickets=a.max_tickets, holding=list(a.holding)))
        except (Refusal, Unavailable) as err:
            self._carry(node, node.lease.handle(lc.LeaseFailed(str(err)), self.w.now))
            return
        assert isinstance(reply, cm.LeaseReply)
        node.nonces.update(((reply.step, i), n) for i, n in zip([*reply.indices, *reply.held], [*reply.nonces, *reply.held_nonces], strict=False))
        node.routes.avoid(reply.step, list(reply.avoid))
        node.routes.suspect(list(reply.suspects))
        self._carry(node, node.lease.handle(lc.Leased(reply.step, list(reply.indices), held=tuple(reply.held)), self.w.now))
        self.poke(node)

    def _release(self, node: SimNode, step: int, tickets: list[int]) -> None:
        if not node.alive or node.silent:
            return
        try:
            self.w.host.request(node.peer, cm.Release(step=step, indices=tickets))
        except (Refusal, Unavailable):
            pass  # the lease runs out instead

    def _complete(self, node: SimNode, a: lc.ReportComplete, epoch: int) -> None:
        if not node.alive or node.silent or node.lease is None:
            return
        try:
            self.w.host.request(node.peer, cm.Complete(step=a.step, index=a.ticket, route=a.route, loss=a.loss, ack=a.ack, nonce=a.nonce))
        except Unavailable:
            self.w.engine.after(COMPLETE_RETRY_S, self._complete, node, a, epoch)
            return
        except Refusal as err:
            self.w.metrics.events[f"complete_refused_{err.code}"] += 1
            if epoch == node.epoch:
                self._carry(node, node.lease.handle(lc.CompleteRefused(a.step, a.ticket, err.code, err.reason), self.w.now))
            return
        self.w.metrics.events["completed"] += 1

    def _report(self, node: SimNode, peer: str, reason: str, lost: int) -> None:
        def send() -> None:
            if not node.alive or node.silent:
                return
            try:
                self.w.host.request(node.peer, cm.Report(target=peer, reason=reason, lost=lost))
            except (Refusal, Unavailable):
                pass

        self.w.engine.after(self._rtt(node), send)
