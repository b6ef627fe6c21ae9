"""The trio adapter that finishes a closed step: it carries out :class:`~protolearn.node.core.closed_step.NodeCore`'s actions.

:meth:`Finisher.finish` feeds the core the closed step, then answers each of its questions with the IO
it names (the gradients this replica holds, the stage's sync of them (:mod:`protolearn.node.replica_sync`:
its collective round or rounds, under the run's compression), fetching the step's result, a redo,
"did the step reopen?", the commit wait, applying the update) until the core says the step is applied,
reopened (wait for the next revision) or lost here (resync). Every decision is the core's; this module
only does reads, writes and waits, and reads time through the node's one clock.

The commit report names the hash of the result this replica holds: a participant's is its collective
round's result hash (the one its signed fin names); a replica that fetched the result hashes it the same
way (per part, over the round's participants, :func:`~protolearn.protocol.collective.result_proof.vector_digest`). If its stage's majority holds
another result, the coordinator refuses the report (``result_mismatch``) and the core resyncs instead of
applying.

In DiLoCo mode (an :class:`~protolearn.node.outer_sync.OuterSync` is passed in) the core is an
:class:`~protolearn.node.core.inner_step.InnerStepCore`: every replica reports the fixed inner-step result
hash, applies its own inner step (:meth:`StageWorker.apply_inner`), and after an outer round's last inner
step runs the outer sync before the step counts as applied.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio
from protolearn.node.averaging import AveragingError, ResultGone
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.core.events import (
    Action,
    Applied,
    Apply,
    AskReopened,
    AskReported,
    Average,
    Closed,
    CommitAnswer,
    Emit,
    Event,
    Fetch,
    Fetched,
    Redo,
    RedoAnswer,
    ReopenAnswer,
    Reported,
    Resync,
    RoundDone,
    RoundFailed,
    Skip,
    StartHeld,
    SyncOuter,
    WaitClosed,
    WaitCommit,
)
from protolearn.node.core.closed_step import NodeCore
from protolearn.node.core.inner_step import INNER_RESULT
from protolearn.node.outer_sync import OuterSync
from protolearn.node.driver import emit
from protolearn.node.progress import Progress
from protolearn.node.replica_sync import ReplicaSync
from protolearn.node.step_timing import StepTimer
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.collective.result_proof import vector_digest

log = logging.getLogger("protolearn.node")
# Long-poll length of one commit wait (the coordinator caps it at 30 s).
COMMIT_POLL_S = 10.0
# How long "did the step reopen?" waits for a closing at the next revision.
REOPEN_POLL_S = 0.5


@dataclass
class StepResult:
    """How finishing a step ended: applied (``revision`` 0), reopened (wait for ``revision``) or resynced."""

    revision: int
    param_hash: str = ""


class Finisher:
    """Finishes closed steps for one built stage. The node passes in what the IO needs."""

    def __init__(
        self,
        core: NodeCore,
        worker: StageWorker,
        sync: ReplicaSync,
        link: CoordinatorLink,
        compute: trio.CapacityLimiter,
        progress: Progress,
        *,
        reported_hashes: Callable[[int], Awaitable[dict[str, str] | None]],
        resync: Callable[[int], Awaitable[None]],
        start_held: Callable[[list], None],
        clock: Callable[[], float] = trio.current_time,
        timing: StepTimer | None = None,
        outer: OuterSync | None = None,
    ) -> None:
        """``outer``: DiLoCo mode's outer rounds (None: the replicas average every step)."""
        self.core = core
        self.outer = outer
        self.timing = timing
        self.worker = worker
        self.sync = sync
        # Replica-sync bytes this replica had sent when it began finishing the step it finishes now.
        self._bytes_mark = (-1, 0)
        self.link = link
        self.compute = compute
        self.progress = progress
        self.reported_hashes = reported_hashes
        self.resync = resync
        self.start_held = start_held
        self.clock = clock

    async def finish(self, step: int, info: cm.StepInfo) -> StepResult:
        """Finish ``step``, closed as ``info`` says; see :class:`StepResult`."""
        self.progress.update(state=cm.NodeState.AVERAGING.value)
        if self._bytes_mark[0] != step:  # a reopened step's later revisions count toward the same step
            self._bytes_mark = (step, self.sync.bytes_sent)
        account = {pt.peer_id: sorted(pt.tickets) for sa in info.accounting if sa.stage == self.core.stage for pt in sa.peers}
        held = await trio.to_thread.run_sync(self.worker.held_tickets, step, limiter=self.compute)
        self._result: torch.Tensor | None = None
        self._result_hash = INNER_RESULT if self.outer is not None else ""
        event: Event | None = Closed(step, info.revision, account, info.loss, held)
        while event is not None:
            actions = self.core.handle(event, self.clock())
            event = None
            for a in actions:
                if isinstance(a, WaitClosed):
                    return StepResult(a.revision)
                if isinstance(a, Resync):
                    await self.resync(a.step)
                    return StepResult(0)
                if isinstance(a, Apply):
                    return StepResult(0, await self._apply(a))
                if isinstance(a, Skip):
                    return StepResult(0, await self._skip(a))
                got = await self._carry(a)
                if got is not None:
                    event = got
        raise RuntimeError(f"the node core left step {step} unfinished in phase {self.core.phase.value}")

    async def _carry(self, a: Action) -> Event | None:
        if isinstance(a, Emit):
            emit(self.progress, a)
            return None
        if isinstance(a, AskReported):
            if a.delay_s:
                await trio.sleep(a.delay_s)
            hashes = await self.reported_hashes(a.step)
            return Reported(a.step, bool(hashes))
        if isinstance(a, Average):
            flat = await trio.to_thread.run_sync(self.worker.flat_grads, a.step, a.tickets, limiter=self.compute)
            try:
                done = await self.sync.average(a.step, a.round, a.weights, flat)
            except AveragingError as err:
                return RoundFailed(a.step, a.revision, str(err), err.causes)
            self._result, self._result_hash = done.result, done.digest.hex()
            return RoundDone(a.step, a.revision, list(done.excluded))
        if isinstance(a, Fetch):
            self._result = None
            # The core's try time, or longer for a vector that the measured link cannot carry in it.
            limit = max(a.try_s, self.sync.fetch_time_s())
            with trio.move_on_after(limit):
                try:
                    self._result = await self.sync.fetch(a.step, a.round, a.weights)
                except ResultGone as err:
                    return Fetched(a.step, a.revision, ok=False, gone=True, reason=str(err))
                except AveragingError as err:
                    log.warning("%s", err)
                    return Fetched(a.step, a.revision, ok=False, reason=str(err))
            if self._result is None:
                return Fetched(a.step, a.revision, ok=False, reason=f"no result within {limit:.3g} s")
            # Hashed outside the fetch's time limit: a result in hand is not lost to a slow hash.
            digest = await trio.to_thread.run_sync(vector_digest, self._result, len(a.weights), limiter=self.compute)
            self._result_hash = digest.hex()
            return Fetched(a.step, a.revision, ok=True)
        if isinstance(a, Redo):
            if a.delay_s:
                await trio.sleep(a.delay_s)
            try:
                reply = await self.link.redo(a.step, a.tickets, a.reason, revision=a.revision, kind=a.kind, causes=a.causes)
            except CoordinatorRefused as err:
                log.log(logging.INFO if a.expected else logging.WARNING, "redo refused step=%d tickets=%s reason=%s", a.step, a.tickets, err.reason)
                return RedoAnswer(a.step, a.revision, granted=False, reason=err.reason, code=err.code)
            except ProtocolError as err:  # unreachable or no answer in time: not a refusal
                return RedoAnswer(a.step, a.revision, granted=None, reason=err.reason)
            self.progress.event("redo", step=a.step, tickets=a.tickets, reason=a.reason, reopened=reply.reopened)
            return RedoAnswer(a.step, a.revision, granted=True)
        if isinstance(a, AskReopened):
            if a.delay_s:
                await trio.sleep(a.delay_s)
            return await self._reopened(a)
        if isinstance(a, WaitCommit):
            self.progress.event("averaged", step=a.step, revision=a.revision, seconds=round(self.core.averaging_seconds(self.clock()), 4))
            if self.timing is not None:
                self.timing.phase("commit")
            try:
                committed = await self.link.wait_committed(
                    a.step, a.revision, report=a.report, poll_s=COMMIT_POLL_S, result_hash=self._result_hash
                )
            except CoordinatorRefused as err:  # result_mismatch: the stage's majority holds another result
                return CommitAnswer(a.step, a.revision, False, refused=err.reason)
            if committed and self.timing is not None:
                self.timing.phase("apply")
            return CommitAnswer(a.step, a.revision, committed)
        if isinstance(a, StartHeld):
            self.start_held(a.payloads)
            return None
        raise TypeError(f"no adapter for node core action {a!r}")

    async def _reopened(self, a: AskReopened) -> ReopenAnswer:
        try:
            info = await self.link.wait_step(a.step, min_revision=a.revision + 1, timeout_s=REOPEN_POLL_S)
        except CoordinatorRefused as err:
            # A refusal is an answer about this step (e.g. it is unknown or stale): it did not reopen.
            return ReopenAnswer(a.step, a.revision, reopened=False, reason=err.reason)
        except ProtocolError as err:
            return ReopenAnswer(a.step, a.revision, reopened=None, reason=err.reason)
        return ReopenAnswer(a.step, a.revision, reopened=info.closed or info.open_step == a.step)

    async def _skip(self, a: Skip) -> str:
        """Count ``a.step`` applied with no update (its result is lost to this stage; see the node core)."""
        async with self.compute:
            param_hash = await trio.to_thread.run_sync(self.worker.step_hash)
            self.worker.applied = a.step + 1
            follow = self.core.handle(Applied(a.step, param_hash), self.clock())
        await trio.to_thread.run_sync(self.worker.forget, a.step, limiter=self.compute)
        await self._follow(follow)
        return param_hash

    async def _apply(self, a: Apply) -> str:
        result = self._result
        if result is None and self.outer is None:
            raise RuntimeError(f"step {a.step}: the node core applies a step without a result")
        t_avg = self.core.averaging_seconds(self.clock())
        # The update and the applied count change together under the compute lock, so a snapshot or a
        # checkpoint (taken under the same lock) never sees new parameters with the old count.
        async with self.compute:
            if result is None:  # DiLoCo: this replica's own inner step on its own tickets
                param_hash, norm = await trio.to_thread.run_sync(self.worker.apply_inner, a.step, a.tickets)
            else:
                param_hash, norm = await trio.to_thread.run_sync(self.worker.apply, a.step, result)
                self.sync.commit(a.step)
            follow = self.core.handle(Applied(a.step, param_hash), self.clock())
        await trio.to_thread.run_sync(self.worker.forget, a.step, limiter=self.compute)
        self.progress.event(
            "step", step=a.step, loss=a.loss, hash=param_hash, tickets=a.tickets, replicas=a.replicas, counted=a.counted,
            grad_norm=norm, averaging_s=round(t_avg, 4), revision=a.revision, inner=self.outer is not None,
            sync_bytes=self.sync.bytes_sent - self._bytes_mark[1] if self._bytes_mark[0] == a.step else None,
        )
        await self._follow(follow)
        return param_hash

    async def _follow(self, actions: list[Action]) -> None:
        """Carry out what the core decided once the step counted applied; in DiLoCo mode that may be an
        outer sync (whose end the core decides on in turn) or, for a replica left out of it, a resync."""
        for b in actions:
            if isinstance(b, SyncOuter) and self.outer is not None:
                done = await self.outer.sync(b)
                await self._follow(self.core.handle(done, self.clock()))
            elif isinstance(b, Resync):
                await self.resync(b.step)
            else:
                await self._carry(b)
