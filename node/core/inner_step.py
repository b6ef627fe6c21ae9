"""The node core in DiLoCo mode: a closed step is this replica's own inner step, and every H steps an outer sync.

:class:`InnerStepCore` is :class:`~protolearn.node.core.closed_step.NodeCore` with four decisions changed
(``[sync] mode = "diloco"``, issue 24). The per-step machinery stays as it is: tickets, the frozen
accounting, redos, reopenings and the commit barrier, so a step still commits only once every stage's
live replicas have finished it, and no replica applies a step that may still reopen.

1. **No collective per step.** A participant holds the gradients of exactly its accounted tickets
   (:func:`~protolearn.node.core.accounting.contribution` checked it), and a replica the accounting left out
   holds none: both report to the commit barrier at once, with one fixed result hash
   (:data:`INNER_RESULT`, since replicas share no result between syncs), and on commit each applies its
   **own** AdamW step on the mean gradient of its own tickets (the left-out one: no update).
2. **Missing tickets are redone**, never replaced by another replica's state: between syncs another
   replica's parameters are no substitute for this one's. (If the redo is refused, the safe fallback is a
   resync to the stage's last synced state, as before.)
3. **A step that committed without this replica** (the coordinator counted it as gone) is skipped: its
   tickets' gradients are lost to this replica, whose parameters are still a valid inner trajectory, so it
   trains on (:class:`~protolearn.node.core.events.Skip`) instead of resyncing.
4. **Every H-th step is an outer boundary** (and the run's last step, so a run ends identical on every
   replica). After applying step ``b = r*H - 1`` the core asks for
   outer round r (:class:`SyncOuter`, carried out by ``node/outer_sync.py`` with
   :mod:`~protolearn.node.core.outer_round`'s decisions) before it counts the step applied. From the close
   of step b until then, work of step ``b + 1`` is refused as ``ahead`` rather than held (a round may wait
   out its grace, and a sender's router then skips this replica briefly instead of waiting on it). :class:`OuterDone` answers: the
   step is then applied (and held work starts), or, if this replica was left out, it resyncs.

Why I1 and I2 hold as restated (DESIGN.md): *every ticket of every inner step is processed exactly once*:
the accounting still assigns each ticket of a closed step to one replica per stage, a replica sums
exactly its accounted tickets (never a redone ticket twice), and a replica that dies before its step
closes has its tickets redone by others as before; one that dies after the close takes those tickets out
with the rest of its inner trajectory, which its stage's next outer round leaves out. *Replicas are
identical after every outer sync*: see ``stages/outer.py`` and ``node/core/outer_round.py``.

The collective's round window (:attr:`InnerStepCore.next_round`) is the next outer round's id, so that
parts of it sent early by a faster replica are held (``node/averaging.py``).
"""

from __future__ import annotations

import logging

from protolearn.node.core.closed_step import CoreConfig, Fallback, NodeCore, Phase
from protolearn.node.core.events import Action, Applied, Closed, Emit, Event, OuterDone, RedoAnswer, Reported, Skip, Synced, SyncOuter
from protolearn.protocol.rounds import REVISIONS_PER_STEP, round_id

# The result hash every replica reports to the commit barrier for an inner step: they share no result.
INNER_RESULT = "inner"


def outer_round_of(step: int, inner_steps: int) -> int:
    """The outer round (1-based) whose inner steps include ``step``: steps ``(r-1)*H .. r*H - 1``."""
    return step // inner_steps + 1


def outer_boundary(round_: int, inner_steps: int, steps: int) -> int:
    """The last inner step of outer round ``round_``: ``r*H - 1``, or the run's last step for its final round
    (a run ends on an outer sync, so its replicas finish identical)."""
    return min(round_ * inner_steps, steps) - 1


def outer_round_id(boundary: int, attempt: int = 1) -> int:
    """The collective round id of the outer round after step ``boundary`` at ``attempt``: that step's round
    ids, which no inner step uses in DiLoCo mode."""
    return round_id(boundary, min(attempt, REVISIONS_PER_STEP))


class InnerStepCore(NodeCore):
    """One replica's decisions in DiLoCo mode (module docstring). ``inner_steps``: H; ``steps``: the run's."""

    def __init__(self, me: str, stage: int, config: CoreConfig, *, inner_steps: int, steps: int, applied: int = 0) -> None:
        super().__init__(me, stage, config, applied=applied)
        self.inner_steps = inner_steps
        self.steps = steps
        # The attempt of the outer round this replica takes part in next (outer_sync.py moves it on a retry).
        self.outer_attempt = 1

    @property
    def next_round(self) -> int:
        r = outer_round_of(self.applied, self.inner_steps)
        return outer_round_id(outer_boundary(r, self.inner_steps, self.steps), self.outer_attempt)

    def boundary(self, step: int) -> bool:
        """Whether ``step`` is the last inner step of an outer round (every H-th, and the run's last)."""
        return (step + 1) % self.inner_steps == 0 or step == self.steps - 1

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, OuterDone):
            return self._outer_done(event, now)
        return super().handle(event, now)

    def _closed(self, event: Closed, now: float) -> list[Action]:
        if self.boundary(event.step) and event.step == self.applied:
            # The outer sync comes after this step, and a round may wait out its grace: senders route the next
            # step's work around this replica meanwhile (refused as ``ahead``) rather than have it held here.
            self.accounting.hold_next = False
        return super()._closed(event, now)

    def _synced(self, event: Synced) -> list[Action]:
        self.accounting.hold_next = True
        return super()._synced(event)

    # -- the four changed decisions ----------------------------------------------------------------
    def _average(self) -> list[Action]:
        return self._commit()

    def _fetch(self) -> list[Action]:
        return self._commit()

    def _reported(self, event: Reported) -> list[Action]:
        self._expect(Phase.ASK_REPORTED, event)
        missing = self._missing
        return [Emit("missing_tickets", {"step": self._step, "tickets": missing}, logging.ERROR,
                     f"step {self._step}: accounted tickets {missing} have no gradients here; asking to redo them"),
                *self._redo(missing, "replica lost the tickets' gradients", Fallback.RESYNC)]

    def _redo_answer(self, event: RedoAnswer, now: float) -> list[Action]:
        if event.granted is False and event.code == "step_committed":
            self._expect(Phase.REDOING, event)
            why = (f"inner step {self._step} committed without this replica; its tickets' gradients are lost here, and it "
                   f"trains on from its own parameters")
            self.phase = Phase.APPLYING
            return [Emit("inner_step_skipped", {"step": self._step, "revision": self._revision}, logging.WARNING, why),
                    Skip(self._step, self._revision, why)]
        return super()._redo_answer(event, now)

    def _applied(self, event: Applied, now: float) -> list[Action]:
        if not self.boundary(event.step):
            return super()._applied(event, now)
        self._expect(Phase.APPLYING, event)
        self.phase = Phase.OUTER
        return [SyncOuter(event.step, outer_round_of(event.step, self.inner_steps))]

    def _outer_done(self, event: OuterDone, now: float) -> list[Action]:
        self._expect(Phase.OUTER, event)
        self.outer_attempt = 1
        self.accounting.hold_next = True
        if event.resync:
            return self._resync(event.reason)
        self.phase = Phase.APPLYING
        return super()._applied(Applied(event.step, event.param_hash), now)
