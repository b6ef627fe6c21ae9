"""When the open step closes: with every ticket done, or at a quorum of them plus a grace window (sans-IO).

By default a step closes when all B of its tickets are done. In a deep swarm with churn the last few
tickets are the slow ones: a microbatch restarted because a peer on its route departed must go through
every stage again, and the step waits for it while every other node idles (the simulator's 32-stage swarm:
99% of a step's tickets done at 309 s of 439). A run with ``batch.departures = "drop"`` already applies a
step without the tickets a departed replica held at its stage; ``batch.close_quorum`` < 1 lets it also close
without the slowest tickets, as Decoupled DiLoCo's quorum and grace window do for learners:

- once ``ceil(close_quorum × B)`` tickets are done, the step has a *grace window* of ``close_grace`` times
  the time it took to get there (from its first lease), so a step that took 300 s to reach its quorum waits
  75 s more at the default 0.25, and a 1 s step 0.25 s;
- it closes when every ticket is done or the window ends, whichever comes first. The tickets not done then
  are *dropped*: no stage accounts for them (every hop of their route is ``DROPPED``), their gradients are in
  no replica's sum, and their loss is not in the step's mean. Each stage's sum stays exactly its accounted
  tickets, each once (I1 as the drop mode reads it); every replica of a stage applies the same (I2).

The rule is relative to the step's own pace, so a slow swarm is not cut short and a fast one does not wait
for a fixed number of seconds. A window that ended with the done count back under the quorum (a redo on
the open step un-completed tickets) does not close the step: it waits for the quorum again.

Who can abuse it: a stage-0 peer that holds leases and never completes them gets its tickets dropped
instead of stalling the step (its late leases are struck as before, ``leases.py``). Nobody can make a step
close early: the count is of completions the coordinator accepted, each from the ticket's leaseholder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class CloseRule:
    """The open step's quorum and grace window (``quorum`` 1.0: close only with every ticket done)."""

    quorum: float = 1.0
    grace: float = 0.25
    opened_at: float | None = None  # the step's first lease
    quorum_at: float | None = None  # when its done tickets first reached the quorum

    def __post_init__(self) -> None:
        if not 0.5 < self.quorum <= 1.0 or not (math.isfinite(self.grace) and self.grace >= 0):
            raise ValueError(f"close quorum {self.quorum} must be in (0.5, 1] and grace {self.grace} finite and >= 0")

    def need(self, num_tickets: int) -> int:
        """Done tickets that make the quorum of a ``num_tickets`` step."""
        return max(1, math.ceil(self.quorum * num_tickets - 1e-9))

    def reset(self, now: float | None = None) -> None:
        """A new step opened (or the step reopened, or the ledger was restored at ``now``)."""
        self.opened_at, self.quorum_at = now, None

    def leased(self, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now

    def completed(self, done: int, num_tickets: int, now: float) -> None:
        """A ticket was done: ``done`` of ``num_tickets`` are."""
        if self.quorum < 1.0 and self.quorum_at is None and done >= self.need(num_tickets):
            self.quorum_at = now

    def due(self, done: int, num_tickets: int, now: float) -> bool:
        """Whether the step should close now without its remaining tickets."""
        if self.quorum_at is None or done >= num_tickets or done < self.need(num_tickets):
            return False
        opened = self.quorum_at if self.opened_at is None else min(self.opened_at, self.quorum_at)
        return now >= self.quorum_at + self.grace * (self.quorum_at - opened)
