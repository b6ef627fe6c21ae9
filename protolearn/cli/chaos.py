"""``protolearn demo --chaos``'s plan: when to SIGKILL and restart which process of the local swarm.

:class:`ChaosPlan` is a plain object (``tick(now, closed_steps, ...)`` returns the next actions; the demo
does them), so a test drives it on a fake clock. Each :class:`Fault` records a kill and its recovery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Fault:
    """One SIGKILL of ``target`` (``node<k>`` or ``coordinator``) and what followed."""

    target: str
    killed_at: float
    closed_at_kill: int
    restarted_at: float | None = None
    # The restarted process is in the swarm again (a node joined; the coordinator answers).
    back: bool = False
    # Seconds from the kill until the next step closed.
    recovered_s: float | None = None


@dataclass
class ChaosPlan:
    """Decides when to kill and restart what (sans-IO: :meth:`tick` returns actions, the caller does them).

    One fault at a time: the next comes ``interval_s`` after the previous one recovered. A node is only
    killed if its stage keeps another live replica; the ``coordinator_fault``-th fault (counting from 0)
    is the coordinator. No fault is started in the last ``quiet_steps`` steps, so the run can end.
    """

    num_nodes: int
    steps: int
    rng: random.Random
    interval_s: float = 4.0
    restart_after_s: float = 1.0
    coordinator_fault: int = 1
    quiet_steps: int = 3
    faults: list[Fault] = field(default_factory=list)
    _next_at: float | None = None

    def tick(
        self, now: float, closed_steps: int, stages: dict[int, int | None], alive: set[int], back: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> list[tuple[str, Any]]:
        """Actions: ("recovered", fault), ("restart", target), ("kill", target).

        ``back`` names restarted targets seen in the swarm again; no new fault starts before every
        restarted target is back (a node still joining would fail to reach a killed coordinator).
        """
        actions: list[tuple[str, Any]] = []
        for f in self.faults:
            if f.restarted_at is not None and not f.back and f.target in back:
                f.back = True
                self._next_at = max(self._next_at or now, now + self.interval_s)
            if f.recovered_s is None and closed_steps > f.closed_at_kill:
                f.recovered_s = now - f.killed_at
                self._next_at = now + self.interval_s
                actions.append(("recovered", f))
            if f.restarted_at is None and now - f.killed_at >= self.restart_after_s:
                f.restarted_at = now
                actions.append(("restart", f.target))
        if any(f.recovered_s is None or not f.back for f in self.faults):
            return actions
        if closed_steps < 2 or closed_steps >= self.steps - self.quiet_steps:
            return actions
        if self._next_at is None:
            self._next_at = now + self.interval_s
        if now < self._next_at:
            return actions
        self._next_at = now + self.interval_s
        if len(self.faults) == self.coordinator_fault:
            target = "coordinator"
        else:
            per_stage: dict[int, int] = {}
            for k in alive:
                st = stages.get(k)
                if st is not None:
                    per_stage[st] = per_stage.get(st, 0) + 1
            # Killing a stage's last replica would stall the run: chaos tests recovery, not loss of a stage.
            candidates = sorted(k for k in alive if stages.get(k) is not None and per_stage[stages[k]] >= 2)  # type: ignore[index]
            if not candidates:
                return actions
            target = f"node{self.rng.choice(candidates)}"
        self.faults.append(Fault(target, now, closed_steps))
        actions.append(("kill", target))
        return actions


__all__ = ["ChaosPlan", "Fault"]
