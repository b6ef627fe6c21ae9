"""The router's decisions, as a sans-IO core: which next-stage peer gets a microbatch, whether a gradient
belongs to the attempt held here, and which hand-overs are lost.

:class:`RouteCore` decides over two owners: the per-ticket record (:class:`~.tickets.Tickets`: the
attempt held, where each output went, the hand-overs whose gradient is awaited) and the balancer's
per-peer statistics (:class:`~.balancer.Balancer`: service times, queues, penalties, losses in a row).
The router (:mod:`protolearn.node.router`) reports what happened on the wire and carries out the
answers; stage 0's driver (:mod:`protolearn.node.driver`) asks it which hand-overs are overdue and
which tickets a failed peer held.

- **Forward.** :meth:`RouteCore.choose` picks among the next stage's live replicas (the node's view,
  :attr:`RouteCore.next_peers`) those not yet tried for this microbatch, or all of them again when every
  one was tried; the hand-overs each still owes a gradient count as its load. A refusal that says the
  peer has not reached the step (``ahead``) skips it briefly (:meth:`RouteCore.refused`); others penalise it. An accepted send (:meth:`RouteCore.accepted`) feeds the balancer its service time and
  the peer's queue and records the hand-over; a refused or broken one penalises the peer.
- **Backward.** A gradient that the accounting admits is still refused when its route up to this
  replica is not that of the attempt held here (:meth:`RouteCore.admit_gradient`): the ticket was
  redone along another route, and the graph held belongs to the new attempt (I1).
- **Liveness** (issue 11): a peer can accept an activation and never send its gradient back. A
  hand-over awaited longer than the balancer's deadline (:meth:`Balancer.deadline_s`) is given up
  (:meth:`RouteCore.overdue`), and each loss in a row doubles its peer's penalty, so it soon gets no
  more work; one returned gradient resets the count and measures the round trip the deadline follows.
"""

from __future__ import annotations

from protolearn.node.core.accounting import Admission
from protolearn.node.core.balancer import Balancer, Choice
from protolearn.node.core.tickets import Key, Tickets


class RouteCore:
    """The routing decisions of one stage replica, over its ticket record and its balancer."""

    def __init__(self, tickets: Tickets | None = None, balancer: Balancer | None = None) -> None:
        self.tickets = tickets if tickets is not None else Tickets()
        self.balancer = balancer if balancer is not None else Balancer()
        # The next stage's live replicas in the node's view (empty on the last stage).
        self.next_peers: list[str] = []
        # (step, peers): next-stage replicas that sit out the rest of that step (the coordinator's word in a
        # lease reply, coordinator/core/round_faults.py): chosen only when no other replica serves.
        self._avoid: tuple[int, frozenset[str]] = (-1, frozenset())

    @property
    def has_next_stage(self) -> bool:
        return bool(self.next_peers)

    # -- forward ---------------------------------------------------------------------------------
    def suspect(self, peers: list[str]) -> None:
        """The coordinator's current suspects among the next stage (:data:`~.balancer.SUSPECT_FACTOR`)."""
        self.balancer.suspects = frozenset(peers)

    def avoid(self, step: int, peers: list[str]) -> None:
        """The coordinator says ``peers`` sit out the rest of ``step`` (a newer step's word replaces an older one's)."""
        if step >= self._avoid[0]:
            self._avoid = (step, frozenset(peers))

    def choose(self, tried: set[str], now: float, step: int | None = None) -> Choice:
        """The next-stage peer for a microbatch of ``step`` already offered to ``tried`` (all again once all
        were); a peer that sits out the step is chosen only when no other serves."""
        peers = self.next_peers
        if step is not None and step == self._avoid[0] and self._avoid[1]:
            peers = [p for p in peers if p not in self._avoid[1]] or peers
        candidates = [p for p in peers if p not in tried] or list(peers)
        return self.balancer.choose(candidates, now, self.tickets.awaited_per_peer())

    def sending(self, peer: str) -> None:
        self.balancer.on_sent(peer)

    def accepted(self, key: Key, peer: str, *, service_s: float, queue_len: float, now: float) -> None:
        """``peer`` took the activation of ``key`` after ``service_s`` and reports ``queue_len`` queued."""
        self.balancer.on_done(peer, service_s)
        self.balancer.on_queue_report(peer, queue_len)
        self.tickets.handed(key, peer, now)

    def failed(self, peer: str, now: float) -> None:
        """``peer`` refused the activation, timed out or broke the stream."""
        self.balancer.on_failure(peer, now)

    def refused(self, peer: str, code: str, now: float) -> None:
        """``peer`` refused the activation with ``code`` (:class:`~protolearn.protocol.pipeline.Refuse`):
        ``ahead`` says it has not reached the step yet (not ready, no failure); any other code is a failure."""
        if code == "ahead":
            self.balancer.on_not_ready(peer, now)
        else:
            self.balancer.on_failure(peer, now)

    # -- backward --------------------------------------------------------------------------------
    def admit_gradient(self, key: Key, route_here: list[str], admission: Admission) -> Admission:
        """The accounting's ``admission`` of a gradient whose route up to this replica is ``route_here``,
        refused when that is not the route of the attempt held here."""
        held = self.tickets.route(key)
        if admission.action == "process" and held is not None and route_here != held:
            step, ticket = key
            return Admission("refuse", f"unknown attempt of (step {step}, ticket {ticket}): it was redone along another route", "unknown")
        return admission

    def returned(self, key: Key, now: float) -> None:
        """The gradient of ``key`` came back."""
        got = self.tickets.returned(key, now)
        if got is not None:
            self.balancer.on_returned(*got)

    # -- liveness --------------------------------------------------------------------------------
    def deadline_s(self, cap_s: float) -> float:
        return self.balancer.deadline_s(cap_s)

    def overdue(self, now: float, cap_s: float) -> list[tuple[Key, str]]:
        """Give up on the hand-overs older than :meth:`deadline_s` (at most ``cap_s``): (key, peer) of each."""
        lost = self.tickets.overdue(now, self.balancer.deadline_s(cap_s))
        for _, peer in lost:
            self.balancer.on_lost(peer, now)
        return lost

    def lost(self, peer: str) -> int:
        """Hand-overs to ``peer`` in a row whose gradient never came back."""
        return self.balancer.lost(peer)

    def handed_to(self, step: int, peer: str) -> list[int]:
        """Tickets of ``step`` whose activation ``peer`` accepted last."""
        return self.tickets.handed_to(step, peer)

    # -- membership ------------------------------------------------------------------------------
    def ban(self, peer: str) -> None:
        self.balancer.ban(peer)

    def forget(self, peer: str) -> list[Key]:
        """The peer left the swarm: drop its statistics and await nothing more from it. Returns the hand-overs
        to it still awaited, oldest first: their microbatches are lost downstream of this replica, which holds
        their activation and sends it on to another replica (:meth:`resend`), so that only the work past it is redone."""
        self.balancer.forget(peer)
        return self.tickets.forget_peer(peer)

    def resend(self, key: Key, held_step: int) -> list[str] | None:
        """The route to send ``key``'s activation on with again after its next-stage peer left, or None when
        there is nothing to send: the ticket is not of ``held_step`` (the step this replica trains), or the
        attempt held here never went out (no activation was kept)."""
        route = self.tickets.route(key)
        if key[0] != held_step or route is None or self.tickets.frame(key, "fwd") is None and self.tickets.sent_to(key, "fwd") is None:
            return None
        return route
