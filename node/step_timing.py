"""Where a node's step goes: compute, the bubble, boundary transfer, replica averaging, the commit barrier.

A :class:`StepTimer` follows one node through each step it trains and writes one ``step_times`` event
per step to the node's log, with the seconds it spent in each of:

- ``compute_s``: the node's compute thread was busy (the compute limiter held: forward, backward, spot
  checks) while the step trained, plus ``apply_s``, the optimizer step after the commit;
- ``transfer_s``: no compute, but a boundary tensor on its way (an activation or gradient being encoded,
  sent and acknowledged, or being received and checked);
- ``bubble_s``: neither: the node waited for the other stages (the pipeline bubble, a lease, the step's
  closing);
- ``averaging_s``: from the step's close until this replica's collective round (or its fetch of the
  result) is done;
- ``commit_s``: waiting at the commit barrier until every stage has averaged the step;
- ``other_s``: after the update (checkpoints, the hash report) until the next step begins.

Every figure is the sum of intervals the timer measured between the node's own events, never a
remainder: the phases (train, averaging, commit, apply, other) follow each other and are marked by the
node (:meth:`phase`), and inside the train phase each instant is attributed to compute when the
compute limiter is held (:meth:`limiter` wraps the node's one limiter), else to transfer when a
transfer is running (:func:`timed_transfer`), else to the bubble. ``wall_s`` is the step's span from
its first mark to :meth:`end`; the parts add up to it. ``transfer_busy_s`` is how long any transfer ran
in the train phase, overlapping compute included. A step reopened to redo tickets trains and averages
again; its figures sum every round (``rounds``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio
from protolearn.node.progress import Progress

PHASES = ("train", "averaging", "commit", "apply", "other")
FIELDS = ("compute", "transfer", "bubble", "averaging", "commit", "apply", "other", "transfer_busy")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class StepTimer:
    """Measures one step at a time on ``clock`` (the node's) and logs it through ``progress``."""

    def __init__(self, progress: Progress, clock: Callable[[], float]) -> None:
        self.progress = progress
        self.clock = clock
        self._step: int | None = None
        self._phase: str | None = None
        self._since = 0.0  # the last mark: the start of the current phase, or of the current train state
        self._started = 0.0
        self._rounds = 0
        self._computing = 0
        self._transferring = 0
        self._transfer_since = 0.0
        self._acc = dict.fromkeys(FIELDS, 0.0)

    # -- phases -----------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step ``step`` starts (once per step); each of its training rounds then starts with ``phase("train")``."""
        now = self.clock()
        self._step, self._started, self._rounds = step, now, 0
        self._acc = dict.fromkeys(FIELDS, 0.0)
        self._phase, self._since = None, now

    def phase(self, name: str) -> None:
        """The current step moves to phase ``name`` (one of :data:`PHASES`)."""
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}")
        if self._step is None:
            return
        self._close(self.clock())
        if name == "train":
            self._rounds += 1
            if self._transferring:
                self._transfer_since = self.clock()
        self._phase = name

    def end(self, step: int) -> None:
        """Step ``step`` is over here: log its ``step_times`` event."""
        if self._step != step:
            return
        now = self.clock()
        self._close(now)
        acc = self._acc
        self.progress.event(
            "step_times", step=step, rounds=self._rounds, wall_s=round(now - self._started, 4),
            compute_s=round(acc["compute"] + acc["apply"], 4), **{f"{k}_s": round(acc[k], 4) for k in FIELDS if k != "compute"},
        )
        self._step = self._phase = None

    def _close(self, now: float) -> None:
        """Book the time since the last mark to the current phase (in train: to the current state)."""
        if self._phase is None:
            return
        if self._phase == "train":
            self._acc[self._train_state()] += now - self._since
            if self._transferring:
                self._acc["transfer_busy"] += now - self._transfer_since
                self._transfer_since = now
        else:
            self._acc[self._phase] += now - self._since
        self._since = now

    def _train_state(self) -> str:
        return "compute" if self._computing else "transfer" if self._transferring else "bubble"

    # -- what runs inside the train phase ---------------------------------------------------------------
    def _busy(self, kind: str, delta: int) -> None:
        if self._phase == "train":
            self._close(self.clock())
        if kind == "compute":
            self._computing += delta
        else:
            if delta > 0 and not self._transferring:
                self._transfer_since = self.clock()
            self._transferring += delta

    @contextmanager
    def transfer(self) -> Iterator[None]:
        self._busy("transfer", 1)
        try:
            yield
        finally:
            self._busy("transfer", -1)

    def limiter(self, inner: trio.CapacityLimiter) -> TimedLimiter:
        """``inner``, with the time it is held counted as compute."""
        return TimedLimiter(inner, self)


class TimedLimiter:
    """A :class:`trio.CapacityLimiter` (for ``trio.to_thread.run_sync(limiter=...)`` and ``async with``)
    that tells its timer while a token is held."""

    def __init__(self, inner: trio.CapacityLimiter, timer: StepTimer) -> None:
        self._inner = inner
        self._timer = timer

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self._inner.acquire_on_behalf_of(borrower)
        self._timer._busy("compute", 1)

    def release_on_behalf_of(self, borrower: object) -> None:
        self._inner.release_on_behalf_of(borrower)
        self._timer._busy("compute", -1)

    async def acquire(self) -> None:
        await self.acquire_on_behalf_of(trio.lowlevel.current_task())

    def release(self) -> None:
        self.release_on_behalf_of(trio.lowlevel.current_task())

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def timed_transfer(fn: F) -> F:
    """Decorate a method of an object with a ``timing`` (:class:`StepTimer` or None): its run is a transfer."""

    @functools.wraps(fn)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        timing: StepTimer | None = self.timing
        if timing is None:
            return await fn(self, *args, **kwargs)
        with timing.transfer():
            return await fn(self, *args, **kwargs)

    return run  # type: ignore[return-value]
