"""A node's stage on disk: periodic checkpoints, and where a (re)starting node takes its stage's state from.

Checkpoints. Every ``checkpoint_every`` applied steps (and when the node leaves or finishes) the node
writes its stage, parameters plus AdamW state plus step and run hash, into
``<data dir>/checkpoints/<run name>-<run hash>`` (one folder per run, so two runs never mix)
with :func:`~protolearn.node.checkpoint.save_checkpoint` (atomic: temp file, fsync, rename; the newest
``checkpoint_keep`` are kept). Every replica writes on the same steps, so the stage files of one step
form a consistent whole model, which ``protolearn export --checkpoints`` assembles. In DiLoCo mode the
stage's state is the one after its last outer sync (its replicas differ between syncs), with the outer
momentum: it is written after the outer syncs in which a multiple of ``checkpoint_every`` steps falls
(:func:`checkpoint_due` with ``span`` H), and at leave.

Restore. :func:`plan_restore` is the sans-IO decision a node makes once it knows its stage, the open
step and the stage's live replicas; it returns a :class:`RestorePlan` with a reason:

- ``local``: live replicas exist, and this node's own checkpoint (its data dir, or ``--checkpoint``)
  is exactly the state they report for the newest step: install it and download nothing. This is the
  crashed-and-restarted node whose stage has not moved since its last checkpoint. No one replica's
  report decides it: the newest step is the upper median of the replicas' latest reported steps, and
  a strict majority of those that reported that step must report the checkpoint's hash for it.
- ``donor``: live replicas exist and the stage moved on (or there is no checkpoint): sync from a
  replica (:func:`~protolearn.node.state_sync.fetch_state`).
- ``checkpoint``: the stage has no live replica (training is halted, ``swarm status`` says which
  stage) and a checkpoint of it exists: install it and continue at the coordinator's open step. The
  coordinator's step is the authority, because the other stages' replicas are already there. If the
  checkpoint is older than the open step, the stage's updates of the steps in between are lost (the
  reason says how many); the other stages keep theirs, so the model stays a trained model, not an init.
  A full swarm restart (coordinator and every node restarted with their data dirs) is this case for
  every stage: each restores its last checkpoint, and training continues from the coordinator's
  persisted step.
- ``init``: no live replica, no checkpoint, and the run has not started (open step 0): the
  deterministic init is the state.
- ``lost``: no live replica, no checkpoint, and the run is past step 0: the node stops with one line
  saying which checkpoint to pass.

:class:`StagePersistence` is the adapter the node calls at its hooks (build/sync, after each step, at
leave), passing the stage's worker and applied-step count. File writes and loads run in a worker
thread under the node's compute limiter, which the node also holds while it applies a step and
advances its count, so a checkpoint is always one consistent (parameters, step) pair.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import trio
from protolearn.node.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    PreparedCheckpoint,
    list_checkpoints,
    load_checkpoint,
    prepare_checkpoint,
    read_checkpoint_info,
    run_folder,
    write_checkpoint,
)
from protolearn.node.config import NodeConfig
from protolearn.node.errors import StateSyncError
from protolearn.node.progress import Progress
from protolearn.node.worker import StageWorker
from protolearn.stages.config import RunConfig

log = logging.getLogger("protolearn.node")

CHECKPOINT_DIR = "checkpoints"
# A checkpoint at leave is written under a shielded scope; never hold a leaving node longer than this.
LEAVE_WRITE_S = 30.0

Source = Literal["local", "donor", "checkpoint", "init", "lost"]


@dataclass(frozen=True)
class RestorePlan:
    source: Source
    reason: str
    checkpoint: CheckpointInfo | None = None
    # Optimizer steps the stage counts as applied once restored (the step it trains next).
    applied: int = 0


def checkpoint_due(applied: int, every: int, target: int, *, span: int = 1) -> bool:
    """Whether to write a checkpoint of the state after ``applied`` steps, which follows the last one by
    ``span`` steps: when a multiple of ``every`` (0 = never) lies in that span, and at the last step.
    ``span`` 1: every ``every`` steps; DiLoCo writes only the state after each outer sync (span H)."""
    return applied > 0 and ((every > 0 and applied // every > (applied - span) // every) or applied >= target)


def plan_restore(
    stage: int, open_step: int, *, num_donors: int, candidate: CheckpointInfo | None, reported: Sequence[tuple[str, int, str]],
    donor_error: str = "",
) -> RestorePlan:
    """Where stage ``stage`` takes its state from (see the module docstring).

    ``reported`` is (replica, step, state hash) as the stage's live replicas reported them to the
    coordinator, after each of their last few applied steps; ``donor_error`` is set when syncing from
    every live replica already failed, and the plan then ignores them.
    """
    if num_donors and not donor_error:
        if candidate is None:
            return RestorePlan("donor", f"stage {stage} has {num_donors} live replicas and this node has no checkpoint of it")
        by_peer: dict[str, dict[int, str]] = {}
        for peer, s, h in reported:
            if h:
                by_peer.setdefault(peer, {})[s] = h
        latest = sorted(max(hs) for hs in by_peer.values())
        newest = latest[len(latest) // 2] if latest else -1  # the upper median: one liar's claim of a later step is outvoted
        said = [hs[newest] for hs in by_peer.values() if newest in hs]
        if newest >= 0 and candidate.step == newest + 1 and 2 * said.count(candidate.state_hash) > len(said):
            return RestorePlan(
                "local", f"the checkpoint of step {candidate.step} is what the stage's replicas hold; nothing to download",
                candidate, candidate.step,
            )
        if newest < 0:
            why = "its replicas have reported no step yet"
        elif candidate.step != newest + 1:
            why = f"the stage moved from step {candidate.step} to {newest + 1}"
        else:
            why = f"the replicas hold other parameters than the checkpoint of step {candidate.step}"
        return RestorePlan("donor", f"{why}; syncing from a live replica")
    lost_why = f"syncing from its replicas failed ({donor_error})" if donor_error else "it has no live replica"
    if candidate is not None:
        if candidate.step == open_step:
            reason = f"stage {stage}: {lost_why}; restored from checkpoint {candidate.path.name}, at the open step {open_step}"
        elif candidate.step < open_step:
            reason = (f"stage {stage}: {lost_why}; restored from checkpoint {candidate.path.name}, {open_step - candidate.step} steps "
                      f"behind the open step {open_step}: this stage's updates of steps {candidate.step}..{open_step - 1} are lost")
        else:
            reason = (f"stage {stage}: {lost_why}; restored from checkpoint {candidate.path.name}, which is newer than the "
                      f"coordinator's open step {open_step}; continuing at the coordinator's step")
        return RestorePlan("checkpoint", reason, candidate, open_step)
    if open_step == 0 and not donor_error:
        return RestorePlan("init", f"stage {stage} starts from the deterministic init (fresh run)")
    if open_step == 0:
        return RestorePlan("init", f"stage {stage}: {lost_why}; the run has not stepped yet, so the deterministic init is its state")
    return RestorePlan(
        "lost",
        f"stage {stage}: {lost_why}, the run is at step {open_step}, and this node has no checkpoint of it; "
        f"restart with `node join --checkpoint stage-{stage}-step-<t>.safetensors` (a checkpoint of this run)",
    )


class StagePersistence:
    """The node's checkpoint writer and restore planner; the node calls it at its hooks."""

    def __init__(self, config: NodeConfig, run: RunConfig, progress: Progress, compute: trio.CapacityLimiter) -> None:
        # This run's checkpoints are written to a folder of their own; any run's are read from all of them.
        self.root = config.data_dir / CHECKPOINT_DIR
        self.dir = self.root / run_folder(run)
        self.every = config.checkpoint_every
        self.keep = config.checkpoint_keep
        self.given = config.checkpoint
        self.run = run
        self.progress = progress
        self.compute = compute
        self._saved: tuple[int, int] | None = None  # (stage, applied) of the last write
        self._failing = False  # the last write failed (a full disk): the next failure is not news
        self._warned_given = False
        # The background writer's inbox while it runs (:meth:`writer`); without one, a step's write is awaited.
        self._inbox: trio.MemorySendChannel[PreparedCheckpoint] | None = None

    # -- which checkpoint --------------------------------------------------------------------
    def candidate(self, stage: int) -> CheckpointInfo | None:
        """``--checkpoint`` if it holds this stage of this run, else the newest of the data dir (None if none)."""
        run_hash = self.run.run_hash()
        if self.given is not None:
            info = read_checkpoint_info(self.given)
            if info.run_hash != run_hash:
                raise CheckpointError(str(self.given), f"belongs to run {info.run_hash[:12]}, not the coordinator's run {run_hash[:12]}; pass a checkpoint of this run")
            if info.stage == stage:
                return info
            if not self._warned_given:
                self._warned_given = True
                self.progress.say(f"note: --checkpoint holds stage {info.stage}, but the coordinator assigned stage {stage}; not using it")
        mine = [i for i in list_checkpoints(self.root) if i.stage == stage and i.run_hash == run_hash]
        return max(mine, key=lambda i: i.step, default=None)

    # -- hooks -------------------------------------------------------------------------------
    async def restore(
        self, stage: int, worker: StageWorker, open_step: int, donors: Sequence[str],
        reported: Callable[[], Awaitable[list[tuple[str, int, str]]]], *, donor_error: str = "",
    ) -> int | None:
        """Install the stage's state from a checkpoint, or keep the init; returns the applied-step count
        installed, or None: sync from ``donors``. ``reported`` asks what the stage's replicas report."""
        candidate = self.candidate(stage)
        got_reported = await reported() if donors and candidate is not None and not donor_error else []
        plan = plan_restore(stage, open_step, num_donors=len(donors), candidate=candidate, reported=got_reported, donor_error=donor_error)
        log.info("restore plan stage=%d source=%s reason=%s", stage, plan.source, plan.reason)
        if plan.source == "donor":
            if candidate is not None:
                self.progress.event("restore", source="donor", reason=plan.reason)
            return None
        if plan.source == "lost":
            raise StateSyncError(plan.reason)
        if plan.source == "init":
            got = await trio.to_thread.run_sync(worker.state_hash, limiter=self.compute)
            self.progress.event("init", stage=stage, hash=got, reason=plan.reason)
            self.progress.say(f"stage {stage}: the run's deterministic initial state (a fresh run)")
            return 0
        info = plan.checkpoint
        if info is None:  # plan_restore always names the checkpoint of a local or checkpoint plan
            raise StateSyncError(f"stage {stage}: restore plan {plan.source} names no checkpoint")

        def install() -> str:
            worker.zero_grads()
            outer: dict | None = {} if worker.outer is not None else None
            load_checkpoint(info.path, self.run, stage, worker.module, worker.optimizer, outer=outer)
            if outer is not None:  # DiLoCo: the checkpoint holds the state after an outer sync, and its momentum
                worker.take_anchor(outer or None)
            return worker.state_hash()

        got = await trio.to_thread.run_sync(install, limiter=self.compute)
        self._saved = (stage, info.step)
        if plan.source == "checkpoint":
            if info.step < open_step:
                log.warning("%s", plan.reason)  # shown on the terminal too
            else:
                self.progress.say(plan.reason)
        else:
            self.progress.say(f"stage {stage}: {plan.reason}")
        self.progress.event("restored", source=plan.source, path=str(info.path), checkpoint_step=info.step, applied=plan.applied, hash=got, reason=plan.reason)
        return plan.applied

    async def after_step(self, stage: int, worker: StageWorker, applied: Callable[[], int], target: int, *, span: int = 1) -> None:
        """Write a checkpoint if one is due after the step just applied (``span``: see :func:`checkpoint_due`).

        Only the copy of the state holds the node's next step back: the background :meth:`writer` puts it on
        disk (0.28 s of the demo stage's 20 MB in a running swarm on 2 cores, every node at the same step).
        While it still writes the one before, this waits for it."""
        if not checkpoint_due(applied(), self.every, target, span=span):
            return
        if self._inbox is None:
            await self.write(stage, worker, applied)
            return
        prepared = await self._prepare(stage, worker, applied)
        if prepared is not None:
            await self._inbox.send(prepared)

    async def writer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the checkpoints :meth:`after_step` took, one at a time, until cancelled (a write under way ends
        first: the thread is not abandoned). :meth:`at_leave` then writes the state the node leaves with."""
        send, receive = trio.open_memory_channel[PreparedCheckpoint](0)
        self._inbox = send
        try:
            task_status.started()
            async for prepared in receive:
                await self._write(prepared)
        finally:
            self._inbox = None

    async def at_leave(self, stage: int, worker: StageWorker, applied: Callable[[], int]) -> None:
        """Write the stage once more as the node leaves (unless nothing changed since the last write)."""
        if applied() == 0:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_WRITE_S):
            await self.write(stage, worker, applied)

    async def write(self, stage: int, worker: StageWorker, applied: Callable[[], int]) -> None:
        """Write the stage; ``applied`` is read under the compute lock, with the parameters it goes with."""
        prepared = await self._prepare(stage, worker, applied)
        if prepared is not None:
            await self._write(prepared)

    async def _prepare(self, stage: int, worker: StageWorker, applied: Callable[[], int]) -> PreparedCheckpoint | None:
        """The stage's state to write (copies), or None if it is the one written last."""
        if self._saved == (stage, applied()):
            return None

        def take() -> PreparedCheckpoint:
            n = applied()  # read under the limiter: no optimizer step runs while this copies

            def prepare() -> PreparedCheckpoint:
                return prepare_checkpoint(self.dir, self.run, stage, n, worker.module, worker.optimizer, outer_momentum=worker.outer_momentum())

            # DiLoCo: the stage's state is the one after the last outer sync (its replicas differ between syncs).
            return worker.with_anchor(prepare) if worker.outer is not None else prepare()

        return await trio.to_thread.run_sync(take, limiter=self.compute)

    async def _write(self, prepared: PreparedCheckpoint) -> None:
        stage, n = prepared.stage, int(prepared.meta["step"])
        try:
            path = await trio.to_thread.run_sync(lambda: write_checkpoint(prepared, keep=self.keep))
        except CheckpointError as err:
            # A full disk must not stop training: the user is told once (and again after a write that
            # worked); every failure is in the event log.
            log.log(logging.INFO if self._failing else logging.ERROR, "checkpoint not written (training goes on without it): %s", err)
            self._failing = True
            self.progress.event("checkpoint_failed", stage=stage, reason=str(err))
            return
        self._failing = False
        self._saved = (stage, n)
        self.progress.event("checkpoint", stage=stage, step=n, path=str(path))
