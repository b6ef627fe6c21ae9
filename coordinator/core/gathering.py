"""The run's start: no ticket of the first step is leased until ``start_members`` nodes have joined (sans-IO).

A swarm whose first node starts training alone sends every early step through one replica per stage, and
the nodes that join seconds later sync its state and miss those steps. An operator who gathers a known
swarm (a lab's machines, friends on a call, a test) sets ``coordinator start --wait-for N``; the default, 1,
starts at once, as a volunteer swarm should. Once the run has started it never waits again: members
leaving later is churn, handled as it always is, not a reason to stop leasing.

A restarted coordinator whose store holds a leased or finished ticket, or a step past the first, has
started. Nodes are told why their lease is empty, and ``swarm status`` says "halted" with the count.
"""

from __future__ import annotations


class Gathering:
    """Whether the run has started, and why not yet."""

    def __init__(self, start_members: int) -> None:
        self.start_members = start_members
        self.started = start_members <= 1

    def restore(self, *, step: int, tickets: int) -> None:
        """A store past the first step, or with a ticket of it leased, is a run that started."""
        self.started = self.started or step > 0 or tickets > 0

    def count(self, live: int) -> bool:
        """``live`` members are present now (after a join, or when a lease is asked for): start the run once there are
        enough. True when this call started it."""
        if self.started or live < self.start_members:
            return False
        self.started = True
        return True

    def waiting(self, live: int) -> str | None:
        """Why no ticket may be leased yet (with ``live`` members counted), or None once the run has started."""
        if self.started:
            return None
        return (f"the run starts when {self.start_members} nodes have joined ({live} so far; "
                "coordinator start --wait-for): start more with `protolearn node join`")
