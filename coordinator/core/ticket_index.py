"""Indexes over the open step's tickets, so that the ticket ledger (``tickets.py``) never scans every ticket.

A lease once scanned the step's tickets three times (three scans of ~5,000 tickets per lease made leasing most of
a 10,000-node simulated swarm's coordinator time), and a departure, a completion and a redo each scanned them
again (13% of that swarm's simulation time, profiled). The ledger owns the tickets and changes them; it tells
the index what changed, and asks it instead of scanning:

- the tickets below ``free_from`` are none free (a hint, moved down whenever one may be free again);
- per holder, the indices it may hold (a superset, pruned as read);
- a bound no running or expired lease ends before, so that looking for lapsed leases costs nothing until one may
  have lapsed;
- kept exact on every change: how many tickets are done, and per peer the done tickets routed through it.

The ledger replaces its ticket list wholesale when a step opens, reopens or is restored; :meth:`TicketIndex.over`
rebuilds everything then, from one pass over the new list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protolearn.coordinator.core.steps import DROPPED, Ticket


class TicketIndex:
    """What :class:`~.tickets.TicketLedger` would otherwise scan its open step's tickets for (module docstring)."""

    def __init__(self) -> None:
        self._tickets: list[Ticket] = []  # the list built for (by identity: the ledger's open step)
        self.free_from = 0
        self.held: dict[str, set[int]] = {}
        self.expiry_floor = math.inf
        self.done = 0
        self.routed: dict[str, set[int]] = {}

    def over(self, tickets: list[Ticket]) -> TicketIndex:
        """This index, rebuilt first if ``tickets`` is another list than it was built for."""
        if self._tickets is tickets:
            return self
        held: dict[str, set[int]] = {}
        routed: dict[str, set[int]] = {}
        floor, done = math.inf, 0
        for t in tickets:
            if t.holder is not None and not t.done:
                held.setdefault(t.holder, set()).add(t.index)
                floor = min(floor, t.expires_at)
            if t.done:
                done += 1
                for p in t.route or ():
                    routed.setdefault(p, set()).add(t.index)
        self._tickets = tickets
        self.free_from, self.held, self.expiry_floor, self.done, self.routed = 0, held, floor, done, routed
        return self

    # -- what changed (the ledger changed the ticket; the index follows) --------------------------------------
    def leased(self, peer: str, index: int, expires_at: float) -> None:
        self.held.setdefault(peer, set()).add(index)
        self.expiry_floor = min(self.expiry_floor, expires_at)

    def lease_ended(self, at: float) -> None:
        """A running lease was cut short to end at ``at``."""
        self.expiry_floor = min(self.expiry_floor, at)

    def completed(self, index: int, route: Sequence[str]) -> None:
        self.done += 1
        for p in route:
            self.routed.setdefault(p, set()).add(index)

    def replaced(self, index: int, old: Ticket) -> None:
        """Ticket ``index``, formerly ``old``, is replaced by one that is not done."""
        if old.done:
            self.done -= 1
            for p in old.route or ():
                self.routed.get(p, set()).discard(index)  # (take_routed took a departed peer's set out first)
        self.freed(index)

    def freed(self, index: int) -> None:
        """Ticket ``index`` may be free now (released, or replaced by an unleased one)."""
        self.free_from = min(self.free_from, index)

    def dropped(self, index: int) -> None:
        """Done ticket ``index`` lost a hop to a departure, in a run that drops them (its route names :data:`DROPPED`)."""
        self.routed.setdefault(DROPPED, set()).add(index)

    # -- what the ledger asks -----------------------------------------------------------------------------------
    def take_routed(self, peer: str) -> set[int]:
        """The done tickets routed through ``peer``, which no longer counts as on their routes."""
        return self.routed.pop(peer, set())

    def holdings(self, peer: str, now: float | None) -> list[int]:
        """The unfinished tickets ``peer`` holds; with ``now``, only those whose lease still runs."""
        held = self.held.get(peer)
        if not held:
            return []
        tickets = self._tickets
        held.difference_update([i for i in held if tickets[i].holder != peer or tickets[i].done])
        return sorted(i for i in held if now is None or tickets[i].expires_at > now)

    def first_free(self, n: int) -> list[Ticket]:
        """Up to ``n`` tickets that nobody holds and that are not done, the first in index order."""
        tickets, i, free = self._tickets, self.free_from, []
        while i < len(tickets) and len(free) < n:
            t = tickets[i]
            if not t.done and t.holder is None:
                free.append(t)
            i += 1
        self.free_from = free[0].index if free else i
        return free

    def expired(self, now: float) -> list[Ticket]:
        """The held, unfinished tickets whose lease has run out by ``now``."""
        if now < self.expiry_floor:
            return []
        held = [t for t in self._tickets if not t.done and t.holder is not None]
        self.expiry_floor = min((t.expires_at for t in held), default=math.inf)
        return [t for t in held if t.expires_at <= now]
