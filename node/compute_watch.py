"""The compute watchdog's adapter: times the node's forwards, backwards and optimizer steps in their thread.

:class:`ComputeWatch` wraps the functions the node hands to its compute thread (:meth:`wrap`), so each
call is timed from when the thread starts it to when it returns, not from when it queued for the compute
limiter. :meth:`watch` wakes at the :class:`~protolearn.node.core.watchdog.Watchdog`'s next deadline (at
most every :data:`POLL_S`, since a call that starts meanwhile moves it) and, when a call is overdue,
hands its :class:`~protolearn.node.core.watchdog.Overdue` to ``on_hung`` once. A wake-up more than
:data:`POLL_S` late means the whole process did not run (SIGSTOP, a starved loop): the running calls'
clocks move on by that much instead. :meth:`attach` wraps a
worker's compute methods in place.

What the node does then (:func:`protolearn.node.lifecycle.run_node`): it leaves the swarm, so the
coordinator hands its leases to others and no round or commit waits for it, and exits with the overdue
call's one line. A Python thread cannot be killed, and trio cannot cancel a task waiting on one, so the
process exits rather than wait for a thread that may never return.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from protolearn.node.core.watchdog import Kind, Overdue, Watchdog

POLL_S = 1.0
# The worker's methods that run a forward, a backward or an optimizer step, and the kind each is timed as.
WATCHED: dict[str, Kind] = {
    "forward": "forward", "recompute": "forward", "forward_backward_last": "backward", "backward": "backward",
    "apply": "optimizer",
}
T = TypeVar("T")


class ComputeWatch:
    """One node's :class:`Watchdog`, fed from the compute thread and read from the event loop."""

    def __init__(self, watchdog: Watchdog | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.watchdog = watchdog if watchdog is not None else Watchdog()
        self.clock = clock  # read in threads too: a thread-safe monotonic clock, not trio's
        self._lock = threading.Lock()

    def wrap(self, kind: Kind, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, timed as a call of ``kind`` while it runs (in whatever thread calls it)."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> T:
            with self._lock:
                token = self.watchdog.started(kind, self.clock())
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.watchdog.finished(token, self.clock())

        return timed

    def attach(self, worker: Any) -> None:
        """Time every compute call of ``worker`` (a :class:`~protolearn.node.worker.StageWorker`): its
        methods in :data:`WATCHED` are replaced, on this instance, by timed ones, so every caller (the
        router, spot checks, the finisher) is watched without passing the watch along."""
        for name, kind in WATCHED.items():
            setattr(worker, name, self.wrap(kind, getattr(worker, name)))

    def overdue(self) -> Overdue | None:
        with self._lock:
            return self.watchdog.overdue(self.clock())

    async def watch(self, on_hung: Callable[[Overdue], Awaitable[None]], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: call ``on_hung`` (once) with the first call found past its bound."""
        task_status.started()
        while True:
            with self._lock:
                deadline = self.watchdog.next_deadline()
                now = self.clock()
            nap = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - now) + 0.01)
            await trio.sleep(nap)
            overslept = self.clock() - now - nap
            if overslept > POLL_S:
                # The process itself was stopped or starved: the running calls did not run either.
                with self._lock:
                    self.watchdog.suspended(overslept)
                continue
            late = self.overdue()
            if late is not None:
                await on_hung(late)
                return
