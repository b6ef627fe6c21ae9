"""Redo admission: who may have which tickets redone, and how much of others' work one peer may (sans-IO).

A redo un-completes tickets (:meth:`~protolearn.coordinator.core.tickets.TicketLedger.redo`). On the open
step it frees them (their route broke); on the step that just closed it *reopens* that step, provided it
has not committed.

**Who may ask.** A peer on the ticket's route (it lost the ticket's graph or gradients), or a
*participant of the same stage*: a peer that the step's frozen accounting lists at stage s and that is
still in stage s. The second case is a surviving replica whose collective left a dead replica's
contribution out. When every participant of a stage is gone (:func:`orphaned`), any member of that stage
may redo the step's tickets: nobody is left who holds that stage's gradients. Every ticket passes through
every stage, so such a peer can only force work to be recomputed: a redo replaces a ticket's completion
and never adds a second one (I1). A peer that took no part in the step cannot touch it. On a reopened
step, a same-stage redo only resets tickets still carrying their frozen route: a late duplicate request
from a second survivor finds them already redone and leaves the new attempts alone.

**How often** (issue 12). A peer may have at most ``max_redos_per_peer`` redos of *other* peers' work
granted per step (:class:`RedoBudget`; its own leases do not count, nor a redo after a failed round whose
cause a strict majority of its stage's participants named: ``round_faults.py``): past that it is flagged
``redo_storm``, once per step however long the storm goes on, and refused ``redo_limit``. Together with
the ledger's cap on revisions, one peer alone can reopen a step at most that many times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protolearn.coordinator.core.members import outgrows
from protolearn.coordinator.core.steps import ClosedStep, Ticket
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal

log = logging.getLogger("protolearn.coordinator")


@dataclass(frozen=True)
class RedoDecision:
    accepted: bool
    reason: str
    indices: list[int] = field(default_factory=list)
    reopened: bool = False
    code: str = "redo_refused"
    # The redo undid work that was not the sender's own lease (a reopening, or another holder's ticket):
    # what a per-peer redo budget counts.
    foreign: bool = False


def orphaned(closed: ClosedStep | None, stage: int, present: Callable[[str], bool]) -> bool:
    """Whether every peer that processed ``closed``'s tickets at ``stage`` is gone (not ``present``: left,
    expired, banned, or its connection closed and stayed closed past the grace)."""
    if closed is None:
        return False
    peers = closed.peers_at(stage) if stage >= 0 else {route[stage] for route in closed.routes if route}
    return bool(peers) and not any(present(p) for p in peers)


def redo_open(
    step: int, tickets: Sequence[Ticket], frozen: ClosedStep | None, wanted: list[int], by: str | None, by_stage: int | None,
    orphaned: bool,
) -> RedoDecision:
    """Which of the open step's ``wanted`` tickets a redo by ``by`` (of ``by_stage``) resets; ``frozen``: the
    accounting the step closed with the last time, when it was reopened (see the module docstring)."""
    peer_of_stage = by is not None and frozen is not None and by_stage is not None and (orphaned or frozen.processed_at(by, by_stage))
    reset = []
    for i in wanted:
        t = tickets[i]
        if by is None or by == t.holder:
            reset.append(i)
        elif peer_of_stage and frozen is not None and frozen.routes[i][by_stage] != by:  # type: ignore[index]
            # About another replica's share of the frozen step: undo it only if it was not redone since.
            if t.done and tuple(t.route or ()) == frozen.routes[i]:
                reset.append(i)
        elif by in (t.route or ()):
            reset.append(i)
        elif not t.done:
            continue  # already pending (e.g. another replica's redo freed it): nothing to undo
        else:
            return RedoDecision(False, f"ticket ({step},{i}) was not leased to or routed through the sender")
    foreign = any(by is not None and tickets[i].holder != by for i in reset)
    return RedoDecision(True, f"tickets {reset} of open step {step} will be redone", reset, foreign=foreign)


def may_reopen(closed: ClosedStep, wanted: list[int], by: str | None, by_stage: int | None, orphaned: bool) -> bool:
    """Whether ``by`` (of ``by_stage``) may reopen ``closed`` to redo ``wanted``: it is a participant of its
    stage, or its stage is orphaned, or it is on the route of every ticket it wants redone."""
    if by is None or orphaned or closed.processed_at(by, by_stage):
        return True
    return all(by in closed.routes[i] for i in wanted)


class RedoBudget:
    """Redos of other peers' work granted per (step, peer); only the open and the last closed step are kept."""

    def __init__(self, limit: int, verdicts: VerdictPolicy) -> None:
        self.limit = limit
        self.verdicts = verdicts
        self._granted: dict[tuple[int, str], int] = {}

    def check(self, peer: str, step: int, now: float) -> None:
        """Raise ``redo_limit`` if ``peer`` had its budget for ``step`` (flagging it the first time)."""
        key = (step, peer)
        if self._granted.get(key, 0) < self.limit:
            return
        if self._granted[key] == self.limit:  # flag once per step, however long the storm goes on
            self._granted[key] += 1
            self.verdicts.flag(peer, "redo_storm", f"asked for more than {self.limit} redos of others' work in step {step}", now)
            log.warning("redo storm peer=%s step=%d: flagged, its further redos of the step are refused", peer, step)
        raise Refusal("redo_limit", f"already had {self.limit} redos of other peers' work granted in step {step}; no more")

    def refund(self, peer: str, step: int) -> None:
        """Give back one redo of ``step`` charged to ``peer``: its cause turned out to be another peer
        (round_faults.py)."""
        key = (step, peer)
        n = self._granted.get(key, 0)
        if n > 1:
            self._granted[key] = n - 1
        elif n == 1:
            del self._granted[key]

    def charge(self, peer: str, step: int, *, num_live: int, oldest: int) -> None:
        """``peer`` had a redo of others' work granted in ``step``; entries before ``oldest`` (the last closed
        step) are dropped once the table outgrows the ``num_live`` members."""
        if outgrows(len(self._granted), num_live):
            self._granted = {k: n for k, n in self._granted.items() if k[0] >= oldest}
        key = (step, peer)
        self._granted[key] = self._granted.get(key, 0) + 1
