"""What changed in the core since the store last wrote it: one :class:`Changes` per request or timer tick.

Each part of the core tracks its own changes (the registry its dirty and forgotten members, the ledger
its dirty tickets and the commit, the verdict policy its new bans, the integrity desk its evidence);
:meth:`~protolearn.coordinator.core.dispatch.CoordinatorCore.drain` takes them all at once into one
:class:`Changes`, and the store (``coordinator/store.py``) writes it in one SQLite transaction before the
reply goes out, so a reply a node has seen is never lost to a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protolearn.coordinator.core.integrity import EvidenceRecord
from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.outer_rounds import Decision
from protolearn.coordinator.core.steps import ClosedStep, Ticket
from protolearn.coordinator.core.verdicts import Ban


@dataclass
class Changes:
    """What changed since the last :meth:`~protolearn.coordinator.core.dispatch.CoordinatorCore.drain`."""

    step: int
    members: list[Member] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # All tickets of the open step when it changed wholesale (close or reopen), else the dirty ones.
    tickets: list[Ticket] = field(default_factory=list)
    tickets_reset: bool = False
    closed: list[ClosedStep] = field(default_factory=list)
    bans: list[Ban] = field(default_factory=list)
    # The new last committed step, when it changed.
    committed: int | None = None
    # The corpus fingerprint, when it was just set.
    corpus: str | None = None
    # Integrity reports judged since the last drain (integrity.py).
    evidence: list[EvidenceRecord] = field(default_factory=list)
    # DiLoCo: each stage's last outer-round decision, when one changed (outer_rounds.py).
    outer: list[Decision] | None = None

    def empty(self) -> bool:
        return not (
            self.members or self.removed or self.tickets or self.tickets_reset or self.closed or self.bans
            or self.committed is not None or self.corpus is not None or self.evidence or self.outer is not None
        )
