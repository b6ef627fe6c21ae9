"""What a stage replica may do with incoming microbatch work, and which tickets it accumulated per step.

A sans-IO core. The replica holds parameters after ``applied`` optimizer steps, so it trains step
``applied`` (steps count from 0). Work for that step is processed. Work for the next step is held
(bounded) until the replica has applied the current one, because step t+1 must see the parameters
after step t. Anything older or further ahead is refused, as is a gradient for a microbatch whose
forward pass this replica never ran (it has no autograd state for it), and new work beyond
``max_in_flight`` microbatches holding activation memory (backpressure, I5).

A forward for a ticket this replica already holds (in flight, or its gradients accumulated) is a
**redo**: the ticket's route broke somewhere and stage 0 started it again. It is processed, and the
worker replaces the earlier graph and gradients, so no ticket is ever counted twice here (I1). Which
tickets go into the step's sum is the coordinator's frozen accounting, never this object's tally:
see :func:`contribution`.

Every decision comes with a reason string for the log line and the refusal sent to the peer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

Key = tuple[int, int]  # (step, ticket)


@dataclass(frozen=True)
class Admission:
    """What to do with the work, why (for the log and the refusal), and, for a refusal, the code the
    sender's retry logic keys on (``busy``: try again or elsewhere; ``stale``, ``ahead``, ``duplicate``,
    ``unknown``, ``invalid``)."""

    action: Literal["process", "defer", "refuse"]
    reason: str
    code: str = ""


@dataclass
class Accounting:
    """Admission of microbatches and per-step ticket bookkeeping for one stage replica."""

    microbatches_per_step: int
    max_in_flight: int
    max_deferred: int
    applied: int = 0
    _in_flight: set[Key] = field(default_factory=set)
    _deferred: deque[tuple[Key, Any]] = field(default_factory=deque)
    _accumulated: dict[int, set[int]] = field(default_factory=dict)
    # Gradients admitted whose backward has not run yet: a second gradient for the same ticket (one per
    # attempt, after a redo) must not reach a graph that the first one already consumed.
    _backward_pending: set[Key] = field(default_factory=set)
    # Work for the next step is held (True) or refused as ``ahead`` (False): while the replica waits long
    # before it can train the next step (DiLoCo's outer sync), a sender had better route elsewhere than wait.
    hold_next: bool = True

    @property
    def step(self) -> int:
        """The step this replica's parameters are ready to train."""
        return self.applied

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def holds(self, step: int, ticket: int) -> bool:
        """Whether (step, ticket) is in flight or already accumulated here."""
        return (step, ticket) in self._in_flight or ticket in self._accumulated.get(step, ())

    def _check_ticket(self, step: int, ticket: int) -> str:
        if not 0 <= ticket < self.microbatches_per_step:
            return f"ticket {ticket} of step {step} is outside 0..{self.microbatches_per_step - 1}"
        return ""

    # -- admission -------------------------------------------------------------------------------
    def admit_forward(self, step: int, ticket: int, payload: Any = None) -> Admission:
        """An activation for (step, ticket) arrived, or stage 0 wants to start that ticket."""
        bad = self._check_ticket(step, ticket)
        if bad:
            return Admission("refuse", bad, "invalid")
        key = (step, ticket)
        if step < self.applied:
            return Admission("refuse", f"stale step {step}: this replica has already applied it (now at step {self.applied})", "stale")
        if step > self.applied + 1:
            return Admission("refuse", f"step {step} is ahead: this replica is at step {self.applied}", "ahead")
        if any(k == key for k, _ in self._deferred):
            return Admission("refuse", f"duplicate microbatch (step {step}, ticket {ticket}) already held for the next step", "duplicate")
        if key in self._in_flight:
            return Admission("process", f"redo of step {step} ticket {ticket}: replaces the attempt in flight here")
        if step == self.applied + 1:
            if not self.hold_next:
                return Admission("refuse", f"step {step} is ahead: this replica is syncing after step {self.applied}", "ahead")
            if len(self._deferred) >= self.max_deferred:
                return Admission("refuse", f"busy: {len(self._deferred)} next-step microbatches already waiting", "busy")
            self._deferred.append((key, payload))
            return Admission("defer", f"held until step {self.applied} is applied")
        if len(self._in_flight) >= self.max_in_flight:
            return Admission("refuse", f"busy: {len(self._in_flight)} microbatches in flight (limit {self.max_in_flight})", "busy")
        self._in_flight.add(key)
        if ticket in self._accumulated.get(step, ()):
            return Admission("process", f"redo of step {step} ticket {ticket}: replaces its earlier gradients here")
        return Admission("process", f"step {step} ticket {ticket} accepted")

    def admit_backward(self, step: int, ticket: int) -> Admission:
        """A gradient for (step, ticket) arrived from the next stage."""
        if (step, ticket) not in self._in_flight:
            return Admission("refuse", f"unknown microbatch (step {step}, ticket {ticket}): no forward pass of it is held here", "unknown")
        if (step, ticket) in self._backward_pending:
            return Admission("refuse", f"unknown attempt: a gradient for (step {step}, ticket {ticket}) is already being applied here", "unknown")
        self._backward_pending.add((step, ticket))
        return Admission("process", f"gradient for step {step} ticket {ticket}")

    # -- completion ------------------------------------------------------------------------------
    def backward_done(self, step: int, ticket: int) -> None:
        """The parameter gradients of (step, ticket) are now in this replica's accumulators."""
        self._in_flight.discard((step, ticket))
        self._backward_pending.discard((step, ticket))
        self._accumulated.setdefault(step, set()).add(ticket)

    def dropped(self, step: int, ticket: int) -> None:
        """The microbatch's route broke before its backward pass (or its graph went to another attempt)."""
        self._in_flight.discard((step, ticket))
        self._backward_pending.discard((step, ticket))

    def gradient_moot(self, step: int, ticket: int) -> None:
        """An admitted gradient found no graph (a redo raced it); a later attempt may still hold the ticket."""
        self._backward_pending.discard((step, ticket))

    def accumulated(self, step: int) -> list[int]:
        """Tickets of ``step`` whose gradients this replica holds, sorted."""
        return sorted(self._accumulated.get(step, ()))

    def mismatch(self, step: int, assigned: list[int]) -> str:
        """Describe how the coordinator's account differs from this replica's tally ("" when equal).

        Informational only: the step's sum is taken over ``assigned`` (see :func:`contribution`).
        """
        mine = set(self.accumulated(step))
        want = set(assigned)
        if mine == want:
            return ""
        return f"step {step}: coordinator accounts tickets {sorted(want)} to this replica, it accumulated {sorted(mine)}"

    def reset(self, applied: int) -> None:
        """The replica took another replica's state after ``applied`` steps: forget all held work."""
        self.applied = applied
        self._in_flight.clear()
        self._backward_pending.clear()
        self._deferred.clear()
        self._accumulated.clear()

    def applied_step(self, step: int) -> list[Any]:
        """Step ``step`` was applied: advance and release the work held for the new step, in arrival order."""
        if step != self.applied:
            raise ValueError(f"applied step {step} but this replica is at step {self.applied}")
        self.applied += 1
        self._accumulated.pop(step, None)
        stale = [k for k in self._in_flight if k[0] <= step]
        for k in stale:
            self._in_flight.discard(k)
        self._backward_pending = {k for k in self._backward_pending if k[0] > step}
        released: list[Any] = []
        while self._deferred:
            (s, t), payload = self._deferred.popleft()
            self._in_flight.add((s, t))
            released.append(payload)
        return released


def contribution(assigned: list[int], held: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Which tickets a replica sums at step close: ``(summed, missing, dropped)``.

    ``summed`` is exactly the coordinator's ``assigned`` tickets that this replica holds gradients
    for; ``dropped`` are held but not assigned (their completion was refused or their route broke
    after this stage, so another attempt counts them); ``missing`` are assigned but not held, which
    must be redone before the step applies.
    """
    a, h = set(assigned), set(held)
    return sorted(a & h), sorted(a - h), sorted(h - a)
