"""The coordinator process's garbage collector: full collections on a timer, not whenever the heap grows,
so that they do not hold up every member's heartbeat every few seconds.

**Why.** py-libp2p keeps about 1,500 objects the collector tracks per member connection (its Noise and
yamux sessions, streams, service tasks, peer-store entries). CPython runs a full collection, which walks
every tracked object, whenever the objects that survived the younger collections grew by a quarter.
Measured with ``bench.py coordinator-net`` (2026-12-07, a ``gc.callbacks`` probe in the coordinator): at
1,500-2,000 members each full collection took 0.7-0.9 s and came every 10-20 s while members joined; each
one held every heartbeat that arrived meanwhile. At 3,500 members the heartbeats' p99 was 2.2 s while the
coordinator used a third of a core: the pauses, not the CPU, missed the 1 s goal. Freezing the heap every
30 s (``gc.freeze``) was not enough: full collections then came every 4-6 s and took up to 0.74 s.

What those collections found was almost nothing: 0-140 objects each, while reference counting frees
everything else at once. So the keeper turns off the automatic full collection (the young generations
still run as usual), freezes the heap the process holds at start-up (imports: permanent), and sweeps
(one full collection) every ``sweep_every_s``: one pause per sweep instead of one every few seconds, and
the few cyclic garbage objects wait at most that long. A collection that pauses the process longer than
``warn_s`` is logged with its duration.

This is a process-wide policy, so the ``coordinator start`` command runs it, not the library's ``serve``
(tests run several coordinators in one process).

:func:`young_collections_only` is the same policy for a batch run, without sweeps: ``scripts/simulate.py``
holds millions of long-lived objects (5 GB at 10,000 simulated nodes) that every full collection walks. At
3,000 nodes over 1 h, full collections took 14.2 s of a 143 s run; without them the run took 125 s with the
same peak memory (839 MB) and the same report field for field.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 600.0
WARN_S = 0.5
# The oldest generation's threshold while the keeper runs: never reached, so only a sweep collects it.
NEVER = 2**31 - 1


class HeapKeeper:
    """Full collections every ``sweep_every_s`` only (module docstring)."""

    def __init__(self, now: float, *, sweep_every_s: float = SWEEP_EVERY_S, warn_s: float = WARN_S) -> None:
        self.sweep_every_s, self.warn_s = sweep_every_s, warn_s
        self._swept_at = now
        self._thresholds: tuple[int, int, int] | None = None
        self._started: float | None = None
        self.sweeps = 0
        self.longest_pause_s = 0.0

    def install(self) -> None:
        """Freeze the start-up heap, stop automatic full collections, and report long pauses."""
        gc.freeze()
        self._thresholds = gc.get_threshold()
        t0, t1, _ = self._thresholds
        gc.set_threshold(t0, t1, NEVER)
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def due_s(self, now: float) -> float:
        """Seconds until the next :meth:`tick` has something to do."""
        return max(0.0, self._swept_at + self.sweep_every_s - now)

    def tick(self, now: float) -> None:
        if now - self._swept_at < self.sweep_every_s:
            return
        t0 = time.perf_counter()
        found = gc.collect()
        log.info("swept the coordinator's heap in %.2f s: %d objects were garbage", time.perf_counter() - t0, found)
        self._swept_at = now
        self.sweeps += 1

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        paused = time.perf_counter() - self._started
        self._started = None
        self.longest_pause_s = max(self.longest_pause_s, paused)
        if paused > self.warn_s:
            log.warning("a garbage collection (generation %d) paused the coordinator for %.2f s", info.get("generation", -1), paused)


@contextmanager
def young_collections_only() -> Iterator[None]:
    """While the block runs, no automatic full collection (the young generations run as usual), with the heap
    held before it frozen; the thresholds are restored after it (module docstring)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
