"""The discrete-event loop of the simulator: a fake clock and a heap of timed calls.

Every piece of the simulated swarm schedules what happens next with :meth:`Engine.at` or
:meth:`Engine.after`; :meth:`Engine.run` pops the earliest call, sets :attr:`Engine.now` to its time and
runs it. Calls at the same time run in the order they were scheduled, so a seeded run repeats exactly.
A call is a function and its arguments (no closure needed), which keeps the hot path cheap: the loop
runs millions of them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Engine:
    """A fake clock (seconds) and the calls scheduled on it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` (not before now)."""
        heapq.heappush(self._queue, (when if when > self.now else self.now, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` ``delay`` seconds from now (:meth:`at`, inlined: most calls are scheduled here)."""
        now = self.now
        heapq.heappush(self._queue, (now + delay if delay > 0 else now, next(self._seq), fn, args))

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run the calls due up to ``until`` (or until ``stop()`` says so, checked every 4,096 calls)."""
        queue, pop = self._queue, heapq.heappop
        n = 0
        while queue and queue[0][0] <= until:
            when, _, fn, args = pop(queue)
            self.now = when
            fn(*args)
            n += 1
            if stop is not None and n & 4095 == 0 and stop():
                break
        self.events += n
        if not queue or queue[0][0] > until:
            self.now = max(self.now, until)

    def __len__(self) -> int:
        return len(self._queue)
