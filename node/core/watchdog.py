"""The compute watchdog's rule: has a forward, backward or optimizer step run too long for this node?

A stuck GPU kernel or driver leaves the thread that computes never returning, while the node's event
loop, heartbeats and connections stay up: its peers see a live node that sends nothing. Only the node
itself can tell that its own compute has stopped, so it watches each call it hands to its compute
thread against its own measured times of that kind of call:

- the bound for a kind is ``factor`` × the median of its last ``window`` durations, and at least
  ``floor_s`` (a loaded machine's ordinary variance, a garbage collection, a checkpoint write);
- before a kind has ``min_samples`` durations, its bound is ``first_s``: the first calls pay one-time
  costs (allocator warm-up, kernel selection) that say nothing about a hang.

:meth:`Watchdog.overdue` names the call that has run past its bound the longest, or None. The adapter
(:mod:`protolearn.node.worker`) asks it on a timer, and when a call is overdue the node reports itself
unhealthy, hands back its tickets and leaves its rounds; if the call returns after all, the node
recovers; if it never does, the node exits with :meth:`Overdue.line`, since a Python thread cannot be
killed. Sans-IO: every method takes ``now``; the adapter reads the clock.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["forward", "backward", "optimizer"]


@dataclass(frozen=True)
class Overdue:
    """One call that has run past its bound."""

    kind: Kind
    running_s: float
    median_s: float | None  # None: no duration of this kind measured yet
    bound_s: float

    def line(self, stage: int) -> str:
        """The one line a node that gives up on its device exits with."""
        median = "no call of this kind has finished yet" if self.median_s is None else f"median {self.median_s:.3g} s"
        return (f"stage {stage} compute ({self.kind}) has not returned for {self.running_s:.0f} s ({median}): "
                "the device may be hung; restart the node")


@dataclass
class Watchdog:
    factor: float = 10.0
    floor_s: float = 5.0
    first_s: float = 120.0
    min_samples: int = 3
    window: int = 64
    _durations: dict[str, deque[float]] = field(default_factory=dict)
    _running: dict[int, tuple[Kind, float]] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and self.floor_s > 0 and self.first_s >= self.floor_s
                and self.min_samples >= 1 and self.window >= self.min_samples):
            raise ValueError(f"watchdog bounds do not hold together: {self!r}")

    def started(self, kind: Kind, now: float) -> int:
        """A call of ``kind`` began at ``now``; returns the token :meth:`finished` takes."""
        token = self._next
        self._next += 1
        self._running[token] = (kind, now)
        return token

    def finished(self, token: int, now: float) -> None:
        """The call behind ``token`` returned (or raised) at ``now``; its duration counts."""
        kind, began = self._running.pop(token)
        self._durations.setdefault(kind, deque(maxlen=self.window)).append(max(0.0, now - began))

    def suspended(self, seconds: float) -> None:
        """The whole process did not run for ``seconds`` (SIGSTOP, a suspended laptop, a starved event
        loop): that time is no call's fault, so every running call's clock moves on by it."""
        self._running = {t: (kind, began + seconds) for t, (kind, began) in self._running.items()}

    def median(self, kind: Kind) -> float | None:
        samples = self._durations.get(kind)
        return statistics.median(samples) if samples else None

    def bound(self, kind: Kind) -> float:
        samples = self._durations.get(kind)
        if samples is None or len(samples) < self.min_samples:
            return self.first_s
        return max(self.floor_s, self.factor * statistics.median(samples))

    def overdue(self, now: float) -> Overdue | None:
        """The running call furthest past its bound, or None while every call is within its own."""
        worst: Overdue | None = None
        for kind, began in self._running.values():
            running, bound = now - began, self.bound(kind)
            if running > bound and (worst is None or running - bound > worst.running_s - worst.bound_s):
                worst = Overdue(kind, running, self.median(kind), bound)
        return worst

    def next_deadline(self) -> float | None:
        """When the earliest running call passes its bound (the adapter sleeps until then), or None."""
        ends = [began + self.bound(kind) for kind, began in self._running.values()]
        return min(ends) if ends else None
