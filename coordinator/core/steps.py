"""The records of a step: a ticket of the open step, and a closed step's frozen accounting.

Step ``t`` is the tickets ``(t, 0..B-1)``. While the step is open, a :class:`Ticket` says who holds its
lease and until when, and, once done, its route (one peer per stage) and the microbatch loss. When all
B are done the step closes and its accounting is frozen in a :class:`ClosedStep`: for each stage, which
peer accounts for which tickets (read off the routes), and the mean loss.

The ledger keeps the last :data:`KEEP_CLOSED` closed steps with their routes in memory (``history.py``
keeps a shorter record of more); the store keeps every closed step.
"""

from __future__ import annotations

from dataclasses import dataclass

# Closed steps kept in memory with their full routes (older ones live in the store only).
KEEP_CLOSED = 1000
# A route's hop whose replica departed holding the ticket's gradients, in a run that drops them (tickets.py):
# no replica accounts for the ticket at that stage.
DROPPED = ""


@dataclass
class Ticket:
    index: int
    holder: str | None = None
    expires_at: float = 0.0
    done: bool = False
    route: list[str] | None = None
    loss: float | None = None
    # Its lease attempt number: one more per lease, ACK_ATTEMPTS more per un-completion (tickets.py), so that the
    # lease nonce of each attempt (protocol/acks.py) is new; persisted with the ticket.
    issued: int = 0


@dataclass(frozen=True)
class ClosedStep:
    step: int
    revision: int
    loss: float
    closed_at: float
    routes: tuple[tuple[str, ...], ...]
    losses: tuple[float, ...]

    @property
    def num_tickets(self) -> int:
        return len(self.routes)

    @property
    def dropped(self) -> int:
        """Tickets the step closed without (close_rule.py): no stage accounts for them. Counted once."""
        got = self.__dict__.get("_dropped")
        if got is None:
            got = sum(1 for route in self.routes if all(peer == DROPPED for peer in route))
            object.__setattr__(self, "_dropped", got)
        return got

    def peers_at(self, stage: int) -> frozenset[str]:
        """Every hop at ``stage`` in the routes (:data:`DROPPED` too where a ticket has none there). Built once
        for every stage: a redo asks it, and scanning the routes per redo was O(B) each at scale."""
        got = self.__dict__.get("_peers_at")
        if got is None:
            sets: dict[int, set[str]] = {}
            for route in self.routes:
                for s, peer in enumerate(route):
                    sets.setdefault(s, set()).add(peer)
            got = {s: frozenset(v) for s, v in sets.items()}
            object.__setattr__(self, "_peers_at", got)
        return got.get(stage, frozenset())

    def accounting(self) -> dict[int, dict[str, list[int]]]:
        """stage → peer → the tickets that peer accounts for in this step.

        Built once (O(B × S)) and then shared: every member's long poll of the closed step reads it, so
        rebuilding it per call made answering a step's close O(members × B × S). Callers must not modify it.
        """
        got = self.__dict__.get("_accounting")
        if got is None:
            got = {}
            for index, route in enumerate(self.routes):
                for stage, peer in enumerate(route):
                    if peer != DROPPED:
                        got.setdefault(stage, {}).setdefault(peer, []).append(index)
            object.__setattr__(self, "_accounting", got)
        return got

    def processed_at(self, peer: str, stage: int | None) -> bool:
        """Whether ``peer`` processed a ticket of this step at ``stage`` (so it averaged that stage)."""
        if stage is None or stage < 0:
            return False
        return peer in self.peers_at(stage)

