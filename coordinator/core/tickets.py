"""Step accounting: the B microbatch tickets of each step, their leases, completions and redo (sans-IO).

Step ``t`` is the tickets ``(t, 0..B-1)`` (their records are in ``steps.py``). Only one step is open
at a time; step ``t+1`` is leasable only once step ``t`` has closed. Stage-0 nodes lease tickets in small blocks; a lease expires after
``lease_s`` and an expired lease is re-issued to whoever asks next (expired ones first, so a stalled
ticket never holds up the step), except its own holder: a lease that ran out, or that a liveness strike
ended, goes back to the peer that sat on it only if no other stage-0 replica could take it, or once it has
waited ``lease_s / 2`` for one (a hung stage-0 node kept asking, was handed its ticket straight back, and
the step waited on it twice more). Completing ticket ``(t, i)`` carries the route (one peer per stage)
and the microbatch loss. Only the current leaseholder may complete it, and a ticket completes at most
once: a late duplicate after a re-issue is refused and never counted twice (I1).

When all B tickets are done the step closes, and its accounting is frozen in a
:class:`~.steps.ClosedStep`. A run that drops departures may also close it at a quorum of done tickets
after a grace window, dropping the rest (``close_rule.py``; :meth:`TicketLedger.close_due`).

:meth:`TicketLedger.redo` un-completes tickets. On the open step it frees them (their route broke).
On the step that just closed it *reopens* that step, provided it has not committed (a replica's
contribution was dropped from the average, so its tickets must be recomputed before anyone applies the
step); the step then closes again with ``revision + 1``. Who may ask for which tickets, and how often, is
``redo.py``'s rule.

**The commit barrier.** A closed step is not yet final: each stage's replicas average it, and a
participant of each stage reports :meth:`TicketLedger.averaged` once its round finished with every
contribution in; a replica the accounting left out reports once it fetched the result. Each report names
the result's hash. When a strict majority of every stage's live replicas hold one hash and every live
replica reported, the step *commits* (the rule and why a liar can neither commit nor block it are in
``coordinator/core/commit.py``): replicas apply it only then, the next step's tickets are leased only then,
and it never reopens. So a replica that dies while its stage averages is never lost: its stage's
survivors redo its tickets and the step reopens, because no stage can have applied it yet (I1).

**Departures.** By default (I1 exact) the open step's tickets that a departing peer leased or that were
routed through it are freed and redone by others. A run with ``batch.departures = "drop"`` keeps a done
ticket routed through the departed peer done and drops it from that peer's stage only (:meth:`revoke_peer`),
and its replicas apply a step whose round left a replica out without that replica's tickets (the node
core's ``tickets_lost`` path; ``dispatch.py`` refuses their redo). I1 then reads: every stage covers each of
the step's tickets at most once, and all of them but those whose gradients a departed replica held there.

**Bounds under attack.** A step reopens at most ``max_revisions`` times: a redo past that is refused
(``revision_cap``) and the last revision stands, so no node's round id overflows. Its replicas take the
node core's refused-redo fallback: a stage whose round left a dead replica out applies what it has (and
logs the lost tickets; I1 gives way to liveness there), and a replica that lost its own gradients
resyncs. At the last revision the commit waits only for the live *participants* of each stage
(:func:`~.commit.waited_for`). What the cap cannot save is a stage whose round failed
outright at the last revision with no replica holding the step: like a stage that lost every replica, it
halts, visibly, until an operator acts. Honest churn stays far below the cap (the node-core simulator's
schedules never pass revision 3), and one peer alone gets at most ``max_redos_per_peer`` reopenings (see
``redo.py``). A completion's loss must be finite and within ``[0, max_loss]``.

Every operation returns a decision with a reason; nothing here raises on a peer's bad request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from protolearn.coordinator.core.close_rule import CloseRule
from protolearn.coordinator.core.commit import AveragedDecision, CommitBarrier, waited_for
from protolearn.coordinator.core.redo import RedoDecision, may_reopen, redo_open
from protolearn.coordinator.core.steps import DROPPED, KEEP_CLOSED, ClosedStep, Ticket
from protolearn.coordinator.core.ticket_index import TicketIndex
from protolearn.protocol.rounds import REVISIONS_PER_STEP

# How many of a ticket's latest leases an ack may name (protocol/acks.py): a late completion of a lease re-issued
# to the same holder still counts. Un-completing a ticket skips that many attempts, so no earlier ack counts.
ACK_ATTEMPTS = 4


@dataclass(frozen=True)
class TicketChanges:
    """What :meth:`TicketLedger.drain` hands the store: the open step's changed tickets (all of them
    when ``reset``: the step changed wholesale) and the new last committed step, if it moved."""

    tickets: list[Ticket]
    reset: bool
    committed: int | None


@dataclass(frozen=True)
class LeaseDecision:
    step: int
    indices: list[int]
    expires_at: float
    reissued: list[int]
    reason: str
    # The open step's tickets the peer held before this lease, their leases running: said again in every answer, so
    # a node that never read the answer that leased them (it gave the request up as the step changed) learns them.
    held: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompleteDecision:
    accepted: bool
    code: str
    reason: str
    closed: ClosedStep | None = None
    remaining: int = 0
    # How long the sender held the ticket's lease before completing it (for the late-lease strikes).
    held_s: float = 0.0


class TicketLedger:
    """The tickets of the open step plus the closed steps' frozen accounting."""

    def __init__(
        self,
        num_tickets: int,
        num_stages: int,
        *,
        lease_s: float,
        block: int,
        step: int = 0,
        tickets: Sequence[Ticket] | None = None,
        closed: Sequence[ClosedStep] = (),
        committed_through: int | None = None,
        keep_closed: int = KEEP_CLOSED,
        max_revisions: int = REVISIONS_PER_STEP,
        max_loss: float = math.inf,
        drop_departed: bool = False,
        close_rule: CloseRule | None = None,
    ) -> None:
        if num_tickets < 1 or num_stages < 1 or keep_closed < 1:
            raise ValueError(
                f"need at least one ticket, stage and kept closed step, got B={num_tickets}, S={num_stages}, keep_closed={keep_closed}"
            )
        self.num_tickets = num_tickets
        self.num_stages = num_stages
        self.lease_s = lease_s
        self.block = block
        self.max_revisions = max_revisions
        self.max_loss = max_loss
        # The run's batch.departures = "drop": a departed peer's done tickets stay done without it (revoke_peer).
        self.drop_departed = drop_departed
        # When the open step closes: every ticket done, or (drop runs) a quorum and a grace window (close_rule.py).
        self.close_rule = close_rule or CloseRule()
        if self.close_rule.quorum < 1.0 and not drop_departed:
            raise ValueError("a step may close at a quorum only in a run that drops departures (batch.departures = \"drop\")")
        # Closed steps kept with their full routes; older ones are dropped as new ones close.
        self.keep_closed = keep_closed
        self.step = step
        self.tickets = list(tickets) if tickets is not None else self._fresh()
        # What a lease, a completion and a departure would scan the tickets for (ticket_index.py): every change to
        # a ticket below is told to it, and it rebuilds itself when ``self.tickets`` is another list (:meth:`_index`).
        self._ix = TicketIndex()
        self.closed: dict[int, ClosedStep] = {c.step: c for c in closed}
        # Tickets whose persisted form changed since the last drain (indices of the open step).
        self.dirty: set[int] = set()
        self.reset = False
        # Counts the times a ticket of the open step may have become free to lease (released, replaced, its lease
        # ended or ran out): the service's waiting leases wake when it changes (coordinator/service.py).
        self.frees = 0
        # The commit barrier: the one owner of the last committed step (see coordinator/core/commit.py). A
        # restored ledger without that field counts its closed steps as committed, which is what the old
        # rule-free swarm did. A fresh run persists "nothing committed" with its first drain: a store
        # without the field reads as "every closed step committed", so a crash between step 0's close and
        # its commit would otherwise restore step 0 as committed, and a replica would apply it without a
        # dead peer's tickets.
        self.barrier = CommitBarrier(num_stages)
        self.barrier.restore(
            step - 1 if committed_through is None else committed_through,
            dirty=committed_through is None and step == 0 and not closed,
        )

    def restore(
        self, *, step: int, tickets: Sequence[Ticket], closed: Sequence[ClosedStep], committed_through: int | None, now: float
    ) -> None:
        """Load the persisted state after a restart; outstanding leases get a fresh term.

        Tickets missing from ``tickets`` start free; without ``committed_through`` (a store from before
        the commit barrier) every closed step counts as committed, as in the constructor. Only the
        refreshed leases (and, as there, a fresh run's "nothing committed") count as changed afterwards.
        """
        by_index = {t.index: t for t in tickets}
        self.step = step
        self.tickets = [by_index.get(i, Ticket(i)) for i in range(self.num_tickets)]
        self.closed = {c.step: c for c in closed[-self.keep_closed :]}
        self.barrier.restore(
            step - 1 if committed_through is None else committed_through,
            dirty=committed_through is None and step == 0 and not closed,
        )
        self.dirty.clear()
        self.reset = False
        self.close_rule.reset(now)  # the time to the quorum counts from the restart
        self.refresh_leases(now)

    def drain(self) -> TicketChanges:
        """Take what changed since the last drain, to persist; the ledger then counts as persisted."""
        if self.reset:
            tickets = list(self.tickets)
        else:
            tickets = [self.tickets[i] for i in sorted(self.dirty)]
        committed = self.committed_through if self.commit_dirty else None
        out = TicketChanges(tickets, self.reset, committed)
        self.dirty.clear()
        self.reset = False
        self.barrier.dirty = False
        return out

    def _fresh(self) -> list[Ticket]:
        return [Ticket(i) for i in range(self.num_tickets)]

    @property
    def last_closed(self) -> int:
        return self.step - 1

    def committed(self, step: int) -> bool:
        return self.barrier.committed(step)

    def averaged(
        self, peer: str, stage: int, step: int, revision: int, *, result_hash: str = "",
        needed: Callable[[int], Iterable[str]] = lambda s: (),
    ) -> AveragedDecision:
        """``peer`` (of ``stage``) holds the full average of ``step`` at ``revision``, hashing to
        ``result_hash``; see :meth:`CommitBarrier.averaged` (``needed(stage)``: the stage's live replicas)."""
        closed = self.closed.get(step)
        revision_now = closed.revision if closed is not None and step == self.last_closed else None
        return self.barrier.averaged(peer, stage, step, revision, result_hash, revision_now, self._needed(needed))

    def try_commit(self, needed: Callable[[int], Iterable[str]]) -> AveragedDecision:
        """Commit the last closed step if its stages agree (called on each report, and again when a
        needed replica leaves or expires)."""
        closed = self.closed.get(self.last_closed)
        return self.barrier.try_commit(self.last_closed, None if closed is None else closed.revision, self._needed(needed))

    def _needed(self, needed: Callable[[int], Iterable[str]]) -> Callable[[int], Iterable[str]]:
        return waited_for(needed, self.closed.get(self.last_closed), self.max_revisions)

    def waited(self, needed: Callable[[int], Iterable[str]]) -> Callable[[int], Iterable[str]]:
        """The replicas the last closed step's commit waits for, given each stage's live ``needed(stage)``."""
        return self._needed(needed)

    @property
    def committed_through(self) -> int:
        """The last step that committed (every closed step before it did too)."""
        return self.barrier.committed_through

    @property
    def commit_dirty(self) -> bool:
        """The commit moved since the last drain (or a fresh run must persist "nothing committed")."""
        return self.barrier.dirty

    def remaining(self) -> int:
        return self.num_tickets - self._index().done

    def _index(self) -> TicketIndex:
        """The index over ``self.tickets``, rebuilt if that is another list than it was built for."""
        return self._ix.over(self.tickets)

    def _replace(self, index: int, ticket: Ticket) -> None:
        """Put ``ticket`` (not done) in place of the open step's ticket ``index``, keeping the index exact."""
        self._index().replaced(index, self.tickets[index])
        self.tickets[index] = ticket
        self.frees += 1
        self.dirty.add(index)

    def _freed(self, index: int) -> None:
        """Ticket ``index`` may be free now (released, or replaced by an unleased one)."""
        self.frees += 1
        self._index().freed(index)

    @property
    def frontier(self) -> int:
        """The first step not yet committed: the stages' state is after the step before it."""
        return self.committed_through + 1

    def lease(self, peer: str, now: float, max_n: int, *, share: int | None = None, others: bool = False) -> LeaseDecision:
        """Lease up to ``max_n`` tickets (at most a block); ``share``: the most ``peer`` may hold at once; ``others``:
        whether another stage-0 replica could take a lease that lapsed on ``peer`` (then ``peer`` waits for it, see
        :meth:`relapse_wait_s`)."""
        n = max(0, min(max_n, self.block))
        # Only running leases count against the share: a lease that ran out is re-issued to whoever asks, its
        # holder too (at once if no other stage-0 replica is present, else after relapse_wait_s). Counting it left
        # a holder that had lost track of its ticket (a coordinator restart mid-step) refused "finish those first"
        # for good, and the step never closed (node-core simulator).
        running = tuple(self.holdings(peer, now))
        held = len(running)
        if share is not None and held >= share:
            return LeaseDecision(self.step, [], 0.0, [], f"already holds its share ({share}) of step {self.step}; finish those first", running)
        if share is not None:
            n = min(n, share - held)
        if not self.committed(self.last_closed):
            return LeaseDecision(self.step, [], 0.0, [], f"step {self.last_closed} has not committed yet; wait for it", running)
        # Costs go to their cause: a lapsed lease goes to another replica first; its own holder takes it back at once
        # only when no other could, and otherwise once it has waited relapse_wait_s for one (nobody else asked).
        picked = [t for t in self._expired(now) if t.holder != peer or not others or now - t.expires_at >= self.relapse_wait_s][:n]
        if len(picked) < n:  # then the first free tickets, in index order
            picked += self._index().first_free(n - len(picked))
        if not picked:
            return LeaseDecision(self.step, [], 0.0, [], f"every ticket of step {self.step} is leased or done; wait for it to close", running)
        expires_at = now + self.lease_s
        self.close_rule.leased(now)
        reissued = []
        for t in picked:
            if t.holder is not None:
                reissued.append(t.index)
            t.holder, t.expires_at = peer, expires_at
            t.issued += 1
            self._ix.leased(peer, t.index, expires_at)
            self.dirty.add(t.index)
        indices = sorted(t.index for t in picked)
        reason = f"leased {len(indices)} tickets of step {self.step}"
        if reissued:
            reason += f" (re-issued expired leases {sorted(reissued)})"
        return LeaseDecision(self.step, indices, expires_at, sorted(reissued), reason, running)

    def release(self, peer: str, step: int, indices: Sequence[int]) -> list[int]:
        """Hand back leased, unfinished tickets (e.g. on a graceful leave)."""
        if step != self.step:
            return []
        out = []
        for i in sorted(set(indices)):
            if 0 <= i < self.num_tickets:
                t = self.tickets[i]
                if t.holder == peer and not t.done:
                    t.holder, t.expires_at = None, 0.0
                    self._freed(i)
                    self.dirty.add(i)
                    out.append(i)
        return out

    @property
    def relapse_wait_s(self) -> float:
        """How long a lapsed lease waits for another replica before its own holder may take it back."""
        return self.lease_s / 2

    def holdings(self, peer: str, now: float | None = None) -> list[int]:
        """The unfinished tickets ``peer`` holds; with ``now``, only those whose lease still runs."""
        return self._index().holdings(peer, now)

    def complete(self, peer: str, step: int, index: int, route: Sequence[str], loss: float, now: float) -> CompleteDecision:
        refused = self.check_complete(peer, step, index, route, loss)
        if refused is not None:
            return refused
        ix, t = self._index(), self.tickets[index]
        held_s = now - self.leased_at(t)
        t.done, t.route, t.loss = True, list(route), float(loss)
        ix.completed(index, t.route)
        self.dirty.add(index)
        remaining = self.remaining()
        if remaining:
            self.close_rule.completed(self.num_tickets - remaining, self.num_tickets, now)
            return CompleteDecision(True, "ok", f"ticket ({step},{index}) done, {remaining} left", remaining=remaining, held_s=held_s)
        closed = self._close(now)
        return CompleteDecision(
            True, "ok", f"ticket ({step},{index}) done; step {step} closed, loss {closed.loss:.4f}", closed, 0, held_s=held_s
        )

    def check_complete(self, peer: str, step: int, index: int, route: Sequence[str], loss: float) -> CompleteDecision | None:
        """The refusal :meth:`complete` would give, or None (cheap: the caller checks this before a signature)."""
        if step < self.step:
            return CompleteDecision(False, "step_closed", f"step {step} is already closed; completion of ticket ({step},{index}) ignored")
        if step > self.step:
            return CompleteDecision(False, "step_not_open", f"step {step} is not open (open step is {self.step})")
        if not 0 <= index < self.num_tickets:
            return CompleteDecision(False, "bad_ticket", f"ticket index {index} is outside 0..{self.num_tickets - 1}")
        t = self.tickets[index]
        if t.done:
            return CompleteDecision(
                False, "duplicate", f"ticket ({step},{index}) was already completed by {t.holder}; duplicate not counted"
            )
        if t.holder != peer:
            who = "never leased" if t.holder is None else f"leased to {t.holder}"
            return CompleteDecision(False, "not_leaseholder", f"ticket ({step},{index}) is {who}, not to the sender")
        if len(route) != self.num_stages:
            return CompleteDecision(False, "bad_route", f"route has {len(route)} hops but the run has {self.num_stages} stages")
        if route[0] != peer:
            return CompleteDecision(False, "bad_route", "route must start at the completing stage-0 peer")
        if not (math.isfinite(loss) and 0.0 <= loss <= self.max_loss):
            return CompleteDecision(False, "bad_loss", f"loss {loss} is not a plausible loss (finite, within 0..{self.max_loss:.4g})")
        return None

    def next_revision(self, step: int) -> int:
        """The revision ``step`` closes at next (1 unless it closed before and was reopened)."""
        prev = self.closed.get(step)
        return prev.revision + 1 if prev is not None else 1

    def close_due(self, now: float) -> ClosedStep | None:
        """Close the open step without its remaining tickets if its quorum's grace window has ended
        (``close_rule.py``; the coordinator's housekeeping asks). Returns the closed step, or None."""
        remaining = self.remaining()
        if not remaining or not self.close_rule.due(self.num_tickets - remaining, self.num_tickets, now):
            return None
        return self._close(now)

    def _close(self, now: float) -> ClosedStep:
        prev = self.closed.get(self.step)
        revision = prev.revision + 1 if prev is not None else 1
        gone = (DROPPED,) * self.num_stages
        # A ticket not done is dropped (close_rule.py): no hop accounts for it, and its loss is NaN, out of the mean.
        routes = tuple(tuple(t.route or ()) if t.done else gone for t in self.tickets)
        losses = tuple(float(t.loss) if t.done and t.loss is not None else math.nan for t in self.tickets)
        kept = [x for x in losses if not math.isnan(x)]
        closed = ClosedStep(
            step=self.step,
            revision=revision,
            loss=sum(kept) / len(kept),
            closed_at=now,
            routes=routes,
            losses=losses,
        )
        self.closed[self.step] = closed
        while len(self.closed) > self.keep_closed:
            del self.closed[min(self.closed)]
        self.step += 1
        self.tickets = self._fresh()
        self.reset = True
        self.barrier.clear()
        self.close_rule.reset()
        return closed

    def redo(
        self,
        step: int,
        indices: Sequence[int],
        *,
        by: str | None = None,
        by_stage: int | None = None,
        orphaned: bool = False,
        revision: int = 0,
    ) -> RedoDecision:
        """Un-complete tickets of the open step, or reopen the step that just closed (if not committed).

        ``by`` (when given) must be on the route of every ticket it redoes, hold its lease, or be a
        participant of stage ``by_stage`` (its current stage) in the step's frozen accounting, or belong
        to a stage whose participants are all gone (``orphaned``); see the module docstring.
        ``revision`` (when given) is the closing the request is about; an older one than the last is stale.
        """
        wanted = sorted(set(indices))
        if any(not 0 <= i < self.num_tickets for i in wanted):
            return RedoDecision(False, f"ticket indices {wanted} are not all within 0..{self.num_tickets - 1}")
        closed = self.closed.get(step)
        if revision and closed is not None and revision < closed.revision:
            return RedoDecision(
                False, f"step {step} closed again at revision {closed.revision} after revision {revision}; average that one",
                code="stale_revision",
            )
        if step == self.step:
            # ``closed`` is set when this step was reopened: the accounting it closed with the last time.
            d = redo_open(step, self.tickets, closed, wanted, by, by_stage, orphaned)
            for i in d.indices:
                self._replace(i, Ticket(i, issued=self.tickets[i].issued + ACK_ATTEMPTS))  # no earlier lease's ack completes it
            return d
        if closed is None or step != self.step - 1:
            return RedoDecision(False, f"step {step} is neither open ({self.step}) nor the last closed step")
        if self.committed(step):
            return RedoDecision(
                False, f"step {step} cannot reopen: it has committed and replicas applied it", code="step_committed"
            )
        if self.remaining() < self.num_tickets:
            return RedoDecision(False, f"step {step} cannot reopen: step {self.step} already has completed tickets")
        if closed.revision >= self.max_revisions:
            return RedoDecision(
                False, f"step {step} closed {closed.revision} times, the most allowed ({self.max_revisions}); revision {closed.revision} stands",
                code="revision_cap",
            )
        if not may_reopen(closed, wanted, by, by_stage, orphaned):
            return RedoDecision(
                False, f"the sender is neither in the route of every ticket {wanted} of step {step} nor a participant of its stage"
            )
        self.step = step
        self.barrier.clear()
        self.close_rule.reset()
        # (A ticket the closing dropped stays done and dropped: its route has no hop, its loss is NaN.)
        self.tickets = [
            Ticket(i, holder=route[0], done=True, route=list(route), loss=loss)
            if i not in wanted
            else Ticket(i)
            for i, (route, loss) in enumerate(zip(closed.routes, closed.losses, strict=True))
        ]
        self.reset = True
        return RedoDecision(True, f"step {step} reopened to redo tickets {wanted}", wanted, reopened=True, foreign=True)

    def revoke_peer(self, peer: str) -> list[int]:
        """Free the open step's tickets leased by ``peer`` or routed through it (it left, expired or was banned).

        With ``drop_departed`` (the run's ``batch.departures = "drop"``) a done ticket routed through ``peer``
        stays done: only ``peer``'s stage loses it, whose hop becomes :data:`~.steps.DROPPED` (no replica
        accounts for it there), while the other stages keep the ticket they already hold. Redoing it instead
        costs the whole pipeline again, and in a deep swarm with churn some peer on most routes departs before
        the step closes, so the step never did. Only its leased, unfinished tickets are freed then.
        """
        return self._undo(peer, self._index().take_routed(peer).union(self.holdings(peer)))

    def forget_routes(self, peer: str) -> list[int]:
        """Undo the open step's done tickets routed through ``peer``, presumed dead (its connection closed and stayed
        closed past the grace), as :meth:`revoke_peer` does: their gradients at its stage were in it alone. Its
        leases are only ended (:meth:`expire_leases`), so a completion of its own still counts if it was alive."""
        return self._undo(peer, self._index().take_routed(peer))

    def _undo(self, peer: str, indices: set[int]) -> list[int]:
        ix, out = self._index(), []
        for i in sorted(indices):
            t = self.tickets[i]
            if t.done and self.drop_departed:
                t.route = [DROPPED if p == peer else p for p in t.route or ()]
                ix.dropped(i)
                self.dirty.add(i)
            else:
                self._replace(i, Ticket(i, issued=t.issued + ACK_ATTEMPTS))
                out.append(i)
        return out

    def expire_leases(self, peer: str, now: float) -> list[int]:
        """End ``peer``'s leases now (its connection is gone): the next lease request re-issues them.

        Unlike :meth:`release` the peer stays the holder until then, so if it was alive after all, its
        completion still counts.
        """
        out = []
        for t in self.tickets:
            if t.holder == peer and not t.done and t.expires_at > now:
                t.expires_at = now
                self._ix.lease_ended(now)
                self.dirty.add(t.index)
                out.append(t.index)
        self.frees += bool(out)
        return out

    def expired(self, now: float) -> list[int]:
        """Leased tickets whose lease has run out (they go to the next lease request)."""
        return [t.index for t in self._expired(now)]

    def noticed_expired(self) -> None:
        """Housekeeping found leases that ran out since it last looked: they are free to lease."""
        self.frees += 1

    def _expired(self, now: float) -> list[Ticket]:
        return self._index().expired(now)

    def leased_at(self, t: Ticket) -> float:
        """When ``t``'s running lease term began: ``lease_s`` before it ends."""
        return t.expires_at - self.lease_s

    def refresh_leases(self, now: float) -> None:
        """After a coordinator restart, give outstanding leases a fresh term (the holders kept working)."""
        for t in self.tickets:
            if not t.done and t.holder is not None:
                t.expires_at = max(t.expires_at, now + self.lease_s)
                self.dirty.add(t.index)

