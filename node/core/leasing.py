"""Stage 0's ticket decisions as a sans-IO core: lease the open step's tickets, start them, restart
broken ones, hand back what cannot start, report completions.

Only a stage-0 replica starts microbatches. While step t is open, :class:`LeaseCore` asks for tickets
(at most ``max_in_flight`` in this replica's hands, ``lease_block`` per request, one request at a
time) and starts each one. It remembers when each in-flight ticket was (re)started and restarts a
ticket whose gradient has not come back within ``stall_s``, whose forward send failed on a next-stage
peer (:class:`PeerDown`), or, after a replica left the membership (:class:`MemberLeft`), every
in-flight ticket: stage 0 cannot know which of them went through it. Starting a ticket again is
safe, because every stage replaces a redone ticket's earlier attempt (I1). A ticket that cannot start
is released to the coordinator; one whose gradient came back is reported complete, and one whose
completion was refused for a broken route is released at once rather than when its lease runs out.

A lease answered with the next step means this step closed; the core keeps asking (slowly) rather
than stopping, because the step may reopen to redo tickets before the node sees it closed, and then
nobody else would lease them. The adapter (:mod:`protolearn.node.driver`) calls
:meth:`LeaseCore.poll` with ``now`` and what it sees (room for more work, whether stage 1 has a
replica), carries out the actions, sleeps until :meth:`LeaseCore.next_wake` or until something
happens, and stops when the node sees the step closed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protolearn.node.core.events import Emit

# Pause after an empty lease (every ticket of the step is taken; doubling, see EMPTY_LEASE_MAX_S) and after a
# failed lease request.
LEASE_RETRY_S = 0.05
LEASE_FAILED_S = 1.0
# With room for no more work, look again at least this often.
IDLE_POLL_S = 1.0
# The coordinator answered with the next step: this step closed. It may still reopen (a redo) before
# the node sees it closed, and then its tickets need leasing again, so ask again after this long.
CLOSED_RETRY_S = 0.25
# A leased ticket that no next-stage peer took (they are gone, or all refused it) is handed back, and leasing
# pauses: LEASE_RETRY_S, doubling with each such ticket in a row up to NOT_STARTED_MAX_S, until one completes.
# Without the pause, a stage whose replicas all left made a lease/release loop at network speed (issue 28:
# each stage-0 node sent the coordinator hundreds of requests a second and was temporarily banned).
NOT_STARTED_MAX_S = 2.0
# An empty lease answer (every ticket of the step is out) is asked again after LEASE_RETRY_S, doubling with each
# empty answer in a row up to this: a ticket freed later (a redo, an expired lease) is picked up within it.
EMPTY_LEASE_MAX_S = 2.0
# Empty answers for this long in a row are logged once, with the coordinator's reason.
IDLE_TOLD_S = 10.0
# A lease asks the coordinator to hold it this long for a ticket to free (``Lease.wait_s``), so a freed ticket (its
# holder died, a redo) is taken as soon as it frees, not after the back-off above. An empty answer after such a
# wait is asked again after LEASE_RETRY_S; one the coordinator did not hold (it had no slot) backs off as above.
LEASE_WAIT_S = 2.0


# -- events ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leased:
    step: int
    indices: list[int]
    # The coordinator held the request for a ticket to free before it answered (``LeaseReply.waited_s`` > 0).
    waited: bool = False
    # Tickets the coordinator has this node holding that its request did not list (``LeaseReply.held``).
    held: tuple[int, ...] = ()
    # Why the answer holds no ticket, when the coordinator says (``LeaseReply.reason``).
    reason: str = ""


@dataclass(frozen=True)
class LeaseFailed:
    reason: str


@dataclass(frozen=True)
class Handed:
    """The ticket's attempt was sent on: a next-stage replica took it."""

    step: int
    ticket: int


@dataclass(frozen=True)
class NotStarted:
    """The ticket could not be sent on (no next-stage replica took it)."""

    step: int
    ticket: int


@dataclass(frozen=True)
class Completed:
    step: int
    ticket: int
    route: list[str]
    loss: float
    # The last stage's signature of the route, loss and lease nonce (protocol/acks.py); None in a one-stage run.
    ack: bytes | None = None
    # The lease nonce that ack signs, as the gradient brought it back.
    nonce: bytes = b""


@dataclass(frozen=True)
class CompleteRefused:
    step: int
    ticket: int
    code: str
    reason: str


@dataclass(frozen=True)
class PeerDown:
    """A forward send to next-stage ``peer`` failed, or its connection closed: ``tickets`` were sent to it."""

    peer: str
    tickets: list[int]


@dataclass(frozen=True)
class MemberLeft:
    """A replica of a later stage left or died: tickets routed through it never get their gradient back."""


LeaseEvent = Leased | LeaseFailed | Handed | NotStarted | Completed | CompleteRefused | PeerDown | MemberLeft


# -- actions ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLease:
    max_tickets: int
    wait_s: float = LEASE_WAIT_S
    # The tickets of the step this replica is working on (``Lease.holding``).
    holding: tuple[int, ...] = ()


@dataclass(frozen=True)
class StartTicket:
    step: int
    ticket: int


@dataclass(frozen=True)
class Release:
    step: int
    tickets: list[int]


@dataclass(frozen=True)
class ReportComplete:
    step: int
    ticket: int
    route: list[str]
    loss: float
    ack: bytes | None = None
    nonce: bytes = b""


LeaseAction = RequestLease | StartTicket | Release | ReportComplete | Emit


class LeaseCore:
    """The tickets one stage-0 replica drives. :meth:`begin` each open step, then :meth:`poll` and :meth:`handle`."""

    def __init__(self, *, max_in_flight: int, lease_block: int, stall_s: float, last_stage: bool) -> None:
        self.max_in_flight = max_in_flight
        self.lease_block = lease_block
        self.stall_s = stall_s
        self.last_stage = last_stage
        self.step = -1
        # When each in-flight ticket of the open step was (re)started.
        self.started: dict[int, float] = {}
        # Started tickets whose attempt is not handed on yet (computing, or trying next-stage peers): a ticket
        # has one attempt at a time, so these are never restarted; the attempt ends Handed or NotStarted.
        # Restarting them once made each failed send to a gone peer restart every ticket again, in a loop
        # at network speed whose releases got the node banned by the coordinator (issue 28).
        self._starting: set[int] = set()
        self._leasing = False
        self._pause_until = 0.0
        self._restart: set[int] = set()
        # Tickets of the step this replica completed or handed back: listed with the started ones in a lease request,
        # so that an answer crossing the completion or release does not name them as lost (``Leased.held``).
        self._settled: set[int] = set()
        self._departed = False
        self._not_started = 0  # tickets in a row that no next-stage peer took
        self._empty = 0  # lease answers in a row with no ticket
        self._empty_since: float | None = None  # when the answers began to hold no ticket; None once one did
        self._told = False  # whether this run of empty answers was logged (once it lasted IDLE_TOLD_S)

    def begin(self, step: int, still_held: list[int], now: float) -> None:
        """Drive ``step``: keep the start times of tickets still held (a reopened step's earlier tickets)."""
        if step != self.step:
            self.started = {}
        held = set(still_held)
        self.started = {t: at for t, at in self.started.items() if t in held}
        self._starting &= set(self.started)
        self.step, self._leasing, self._pause_until = step, False, now
        self._empty = 0  # a new step, or a reopened one whose redone tickets are to be had now: no back-off left
        self._restart.clear()
        self._settled.clear()

    def poll(self, now: float, *, in_flight: int, has_next_stage: bool) -> list[LeaseAction]:
        """What to start, restart or lease now."""
        out: list[LeaseAction] = []
        restart = [t for t, at in self.started.items() if now - at > self.stall_s]
        restart += sorted(t for t in self._restart if t in self.started and t not in restart)
        if self._departed:
            restart = sorted(self.started)
        self._departed = False
        self._restart.clear()
        for t in [t for t in restart if t not in self._starting]:
            self._begin_attempt(t, now)
            out.append(Emit("ticket_redo", {"step": self.step, "ticket": t, "reason": "route broke"}, logging.WARNING,
                            f"ticket restarted step={self.step} ticket={t} reason=its route broke (no gradient back)"))
            out.append(StartTicket(self.step, t))
        if self._leasing or now < self._pause_until:
            return out
        if not self.last_stage and not has_next_stage:
            # No replica of stage 1 yet: leased tickets would only expire in our hands.
            self._pause_until = now + 4 * LEASE_RETRY_S
            return out
        room = self.max_in_flight - in_flight
        if room > 0:
            self._leasing = True
            out.append(RequestLease(min(room, self.lease_block), holding=tuple(sorted(self._settled.union(self.started)))))
        return out

    def _begin_attempt(self, ticket: int, now: float) -> None:
        self.started[ticket] = now
        self._starting.add(ticket)

    def next_wake(self, now: float) -> float:
        """When :meth:`poll` has something to do at the latest, if nothing happens before."""
        wake = now + IDLE_POLL_S
        handed = [at for t, at in self.started.items() if t not in self._starting]
        if handed:
            wake = min(wake, min(handed) + self.stall_s)
        if self._pause_until > now:
            wake = min(wake, self._pause_until)
        return max(now, wake)

    def _idle(self, reason: str, now: float) -> list[LeaseAction]:
        """An answer with no ticket: a stage-0 replica that gets none for IDLE_TOLD_S says why, once (the run waits
        for more nodes, a step waits to commit); otherwise its log shows nothing while it idles."""
        if self._empty_since is None:
            self._empty_since, self._told = now, False
        if self._told or now - self._empty_since < IDLE_TOLD_S:
            return []
        self._told = True
        idle_s = now - self._empty_since
        return [Emit("lease_idle", {"step": self.step, "for_s": round(idle_s, 1), "reason": reason}, logging.INFO,
                     f"no ticket for {idle_s:.0f} s: {reason or 'every ticket is out'}")]

    def handle(self, event: LeaseEvent, now: float) -> list[LeaseAction]:
        if isinstance(event, Leased):
            self._leasing = False
            if event.step != self.step:
                # The step closed. The next step's tickets are not ours to start before this one is
                # applied; and this one may reopen before the node sees it closed, so keep asking.
                self._pause_until = now + CLOSED_RETRY_S
                return [Release(event.step, list(event.indices))] if event.indices else []
            out: list[LeaseAction] = []
            lost = [t for t in event.held if t not in self.started and t not in self._settled and t not in event.indices]
            if lost:
                # Leased to this node in an answer it never read (it gave that request up as the step changed): the
                # coordinator counts them as this node's, and nobody else gets them while their leases run.
                out.append(Emit("lease_recovered", {"step": self.step, "tickets": lost}, logging.WARNING,
                                f"tickets {lost} of step {self.step} were leased to this node in an answer it never read; starting them"))
                for t in lost:
                    self._begin_attempt(t, now)
                out += [StartTicket(event.step, t) for t in lost]
                self._empty = 0
                self._empty_since = None
            if not event.indices and not lost:
                out += self._idle(event.reason, now)
            if not event.indices and (event.waited or lost):
                # The coordinator held the request and no ticket freed (it holds the next one too), or the answer gave
                # back lost tickets: ask again soon.
                self._pause_until = now + LEASE_RETRY_S
                self._empty = 0
                return out
            if not event.indices:
                # Every ticket is leased or done: ask again later, backing off while the answer stays empty. At a
                # fixed LEASE_RETRY_S each stage-0 replica sent the coordinator 20 requests a second for the whole
                # of a step whose tickets were all out (312 replicas of a 10,000-node swarm: 6,000 a second).
                self._pause_until = now + min(EMPTY_LEASE_MAX_S, LEASE_RETRY_S * 2 ** min(self._empty, 16))
                self._empty += 1
                return out
            self._empty = 0
            self._empty_since = None
            # A ticket we hold may come back: our lease ran out, or the step reopened to redo it.
            for t in event.indices:
                self._begin_attempt(t, now)
            return out + [StartTicket(event.step, t) for t in event.indices]
        if isinstance(event, LeaseFailed):
            self._leasing = False
            self._pause_until = now + LEASE_FAILED_S
            return [Emit("lease_failed", {"step": self.step, "reason": event.reason}, logging.WARNING,
                         f"lease failed step={self.step} reason={event.reason}")]
        if isinstance(event, Handed):
            if event.step == self.step:
                self._starting.discard(event.ticket)
            return []
        if isinstance(event, NotStarted):
            self.started.pop(event.ticket, None)
            self._starting.discard(event.ticket)
            pause = min(NOT_STARTED_MAX_S, LEASE_RETRY_S * 2 ** min(self._not_started, 16))
            self._not_started += 1
            self._pause_until = max(self._pause_until, now + pause)
            self._settled.add(event.ticket)
            return [Release(event.step, [event.ticket])]
        if isinstance(event, Completed):
            self._not_started = 0
            self.started.pop(event.ticket, None)
            self._starting.discard(event.ticket)
            self._settled.add(event.ticket)
            return [ReportComplete(event.step, event.ticket, list(event.route), event.loss, event.ack, event.nonce)]
        if isinstance(event, CompleteRefused):
            out: list[LeaseAction] = [Emit("complete_refused", {"step": event.step, "ticket": event.ticket, "reason": event.reason},
                                           logging.WARNING, f"complete refused step={event.step} ticket={event.ticket} reason={event.reason}")]
            if event.code in ("bad_route", "bad_ack", "bad_loss"):
                # A replica on its route left or moved, or the attempt's ack or loss does not check out:
                # hand the ticket back so it is redone now.
                out.append(Release(event.step, [event.ticket]))
                self._settled.add(event.ticket)
            return out
        if isinstance(event, PeerDown):
            self._restart.update(event.tickets)
            return []
        if isinstance(event, MemberLeft):
            self._departed = True
            return []
        raise TypeError(f"not a lease core event: {event!r}")
