"""The closed steps as the core tells of them: a loss record per closing, and the long poll's answer (sans-IO).

When all tickets of a step are done, the ledger freezes its accounting in a
:class:`~.steps.ClosedStep` (``tickets.py``). :class:`StepHistory` then keeps a :class:`LossRecord` of it
(the last :data:`KEEP_HISTORY` of them, what `swarm status` and tokens/s read; a reopened step that
closes again replaces its record), holds the closings the store has not written yet, and answers the
long poll (``WaitStep``): whether step ``t`` closed, at which revision, with which accounting and
whether it committed. Steps older than the ledger keeps with their routes are answered from the records
(closed, with their loss, and no accounting).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from protolearn.coordinator.core.steps import ClosedStep
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.protocol import coordination as cm

# Compact (step, loss, tickets, closed_at) history kept in memory for status and tokens/s.
KEEP_HISTORY = 10_000
# Closings whose long-poll accounting is kept built.
KEEP_ACCOUNTS = 4


@dataclass(frozen=True)
class LossRecord:
    """A closed step in brief: the history behind `swarm status` and tokens/s (routes are in :class:`~.steps.ClosedStep`)."""

    step: int
    loss: float
    tickets: int
    closed_at: float


class StepHistory:
    """The loss record of each closing, the closings not yet persisted, and :meth:`step_info`."""

    def __init__(self, ledger: TicketLedger) -> None:
        self.ledger = ledger
        self.records: deque[LossRecord] = deque(maxlen=KEEP_HISTORY)
        self._unsaved: list[ClosedStep] = []
        # The wire form of the last closings' accounting, built once per closing: every member's long poll of a
        # closed step gets it, so building it per answer made a step's close O(members × B × S).
        self._accounts: dict[tuple[int, int], list[cm.StageAccount]] = {}

    def restore(self, records: Iterable[LossRecord]) -> None:
        self.records.extend(records)

    def closed(self, closed: ClosedStep) -> None:
        """The ledger just closed ``closed`` (perhaps again, after a reopening)."""
        self._unsaved.append(closed)
        while self.records and self.records[-1].step >= closed.step:
            self.records.pop()  # a reopened step closes again: replace its point
        # The tickets it trained: a step closed at its quorum dropped some (close_rule.py).
        self.records.append(LossRecord(closed.step, closed.loss, closed.num_tickets - closed.dropped, closed.closed_at))

    def drain(self) -> list[ClosedStep]:
        """Take the closings made since the last drain, to persist."""
        out, self._unsaved = self._unsaved, []
        return out

    def step_info(self, step: int, min_revision: int = 1) -> cm.StepInfo:
        """The step's frozen accounting once closed (at ``min_revision`` or later), else ``closed=False``."""
        ledger = self.ledger
        open_step = ledger.step
        closed = ledger.closed.get(step)
        if step >= open_step or closed is None or closed.revision < min_revision:
            if step < open_step and closed is None:
                point = next((p for p in self.records if p.step == step), None)
                return cm.StepInfo(
                    step=step, closed=True, revision=1, loss=point.loss if point else None,
                    num_tickets=ledger.num_tickets, accounting=[], open_step=open_step, committed=ledger.committed(step),
                )
            rev = closed.revision if closed is not None else 0
            return cm.StepInfo(
                step=step, closed=False, revision=rev, loss=None, num_tickets=ledger.num_tickets, accounting=[], open_step=open_step,
            )
        accounting = self._accounts.get((step, closed.revision))
        if accounting is None:
            accounting = [
                cm.StageAccount(stage=stage, peers=[cm.PeerTickets(peer_id=p, tickets=t) for p, t in sorted(peers.items())])
                for stage, peers in sorted(closed.accounting().items())
            ]
            if len(self._accounts) >= KEEP_ACCOUNTS:
                del self._accounts[min(self._accounts)]
            self._accounts[(step, closed.revision)] = accounting
        return cm.StepInfo(
            step=step, closed=True, revision=closed.revision, loss=float(closed.loss),
            num_tickets=closed.num_tickets, accounting=accounting, open_step=open_step, committed=ledger.committed(step),
        )
