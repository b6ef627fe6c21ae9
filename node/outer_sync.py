"""The trio adapter of a DiLoCo outer round: carries out :class:`~protolearn.node.core.outer_round.OuterRoundCore`'s actions.

The node core in DiLoCo mode (:mod:`protolearn.node.core.inner_step`) asks for an outer sync after the
last inner step of each outer round (:class:`~protolearn.node.core.events.SyncOuter`); :meth:`OuterSync.sync`
runs that round and answers with :class:`~protolearn.node.core.events.OuterDone`. The IO it does, each an
answer to one action of the round's core:

- the long poll of the coordinator's decision (:meth:`CoordinatorLink.outer_ready`), naming this replica's
  anchor (its state after the last sync) and the first inner step its parameters cover since it took it;
- the pseudo-gradient's one path to the wire: the stage's :class:`~protolearn.node.replica_sync.ReplicaSync`
  (the run's ``[sync] compression``, as a step's gradients in step mode) is handed the flat float32 vector
  ``weight * (anchor - theta)`` and the round's weights, keyed by the round's last inner step, and returns
  the round's sum; divided by the summed weight of the contributors it kept, that is the token-weighted
  mean pseudo-gradient (what every survivor holds alike);
- a fetch of the round's result from its participants, for a follower or a participant whose own round
  failed: :meth:`ReplicaSync.fetch`, the one fetch path of both modes, which takes only a full round's
  result proven by a strict majority of the participants' signed fins
  (:mod:`protolearn.protocol.collective.result_proof`), divided by the round's summed weight;
- the outer step itself under the compute lock (:meth:`StageWorker.apply_outer`), after which the new
  anchor's hash is recorded for the heartbeat (what the stage's replicas compare, I2) and a checkpoint of
  it is written when one is due.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import trio
from protolearn.node.averaging import AveragingError
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.core.events import Emit, OuterDone, SyncOuter
from protolearn.node.core.inner_step import InnerStepCore
from protolearn.node.core.outer_round import (
    ApplyOuter,
    AskReady,
    AverageFailed,
    Averaged,
    AverageOuter,
    Decided,
    FetchOuter,
    Fetched,
    Finish,
    Installed,
    OuterAction,
    OuterEvent,
    OuterRoundCore,
    Unanswered,
    total_weight,
)
from protolearn.node.driver import emit
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.replica_hashes import ReplicaHashes
from protolearn.node.replica_sync import ReplicaSync
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.rounds import PHASES_PER_REVISION, phase_round

log = logging.getLogger("protolearn.node")
# Long-poll length of one ask for the round's decision (the coordinator caps it at 30 s).
READY_POLL_S = 10.0


class OuterSync:
    """Runs the outer rounds of one built stage; the node makes one per build (DiLoCo mode only)."""

    def __init__(
        self, core: InnerStepCore, worker: StageWorker, replica_sync: ReplicaSync, link: CoordinatorLink, compute: trio.CapacityLimiter,
        progress: Progress, *, hashes: ReplicaHashes, persistence: StagePersistence, target_steps: int, ask_timeout_s: float,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """``replica_sync``: the stage's replica sync (the seam to the collective, compressed as the run says); ``hashes``:
        where the new anchor's hash goes for the heartbeat; ``persistence``: writes a checkpoint of it when one is
        due (``target_steps``: this node's last step)."""
        self.core = core
        self.worker = worker
        self.replica_sync = replica_sync
        self.link = link
        self.compute = compute
        self.progress = progress
        self.hashes = hashes
        self.persistence = persistence
        self.target_steps = target_steps
        self.ask_timeout_s = ask_timeout_s
        self.clock = clock
        self._result: torch.Tensor | None = None

    async def sync(self, a: SyncOuter) -> OuterDone:
        """Outer round ``a.round`` after inner step ``a.step``; see the module docstring."""
        oc = OuterRoundCore(self.core.me, self.core.stage, a.round, a.step, ask_timeout_s=self.ask_timeout_s)
        self._result = None
        started, bytes_before = self.clock(), self.replica_sync.bytes_sent
        actions = oc.start(started)
        while True:
            event: OuterEvent | None = None
            for act in actions:
                if isinstance(act, Finish):
                    self.progress.event(
                        "outer_sync", round=a.round, step=a.step, attempt=oc.attempt, role=oc.role, resync=act.resync,
                        hash=act.param_hash, reason=act.reason, weights=oc.weights, seconds=round(self.clock() - started, 4),
                        sync_bytes=self.replica_sync.bytes_sent - bytes_before,
                    )
                    return OuterDone(a.step, act.param_hash, act.resync, act.reason)
                got = await self._carry(act, oc, a.step)
                if got is not None:
                    event = got
            self.core.outer_attempt = oc.attempt  # the averager's window follows a retry
            if event is None:
                raise RuntimeError(f"outer round {a.round}: the round's core asked nothing ({actions})")
            actions = oc.handle(event, self.clock())

    async def _carry(self, act: OuterAction, oc: OuterRoundCore, step: int) -> OuterEvent | None:
        if isinstance(act, Emit):
            emit(self.progress, act)
            return None
        if isinstance(act, AskReady):
            if act.delay_s:
                await trio.sleep(act.delay_s)
            return await self._ask(act)
        if isinstance(act, AverageOuter):
            return await self._average(act, step)
        if isinstance(act, FetchOuter):
            return await self._fetch(act, step)
        if isinstance(act, ApplyOuter):
            return await self._apply(act, step)
        raise TypeError(f"no adapter for outer round action {act!r}")

    async def _ask(self, act: AskReady) -> OuterEvent:
        outer = self.worker.outer
        assert outer is not None  # a DiLoCo worker
        try:
            # anchor_hash: its state after the last sync; since_step: the first inner step its parameters cover since it took it.
            reply = await self.link.outer_ready(cm.OuterReady(
                stage=self.core.stage, round=act.round, attempt=act.attempt, anchor_hash=outer.anchor_hash,
                since_step=max(0, outer.since_step), tokens=0, timeout_s=min(READY_POLL_S, cm.MAX_WAIT_S),
            ))
        except CoordinatorRefused as err:  # an answer about this round: this replica cannot take part
            return Decided("left_out", f"the coordinator refused outer round {act.round}: {err.detail}")
        except ProtocolError as err:
            return Unanswered(err.reason)
        weights = {w.peer_id: w.weight for w in reply.weights}
        return Decided(reply.role, reply.reason, weights, tuple(reply.followers))

    async def _average(self, act: AverageOuter, step: int) -> OuterEvent:
        weight = act.weights[self.core.me]

        def contribution() -> torch.Tensor:
            return self.worker.pseudo_gradient() * weight  # (N,)

        flat = await trio.to_thread.run_sync(contribution, limiter=self.compute)
        try:
            done = await self.replica_sync.average(step, act.round_id, act.weights, flat)
        except AveragingError as err:
            # Say so at once to a participant that asks this one for the result (it retries sooner).
            for phase in range(PHASES_PER_REVISION):
                self.replica_sync.averager.finished.done(phase_round(act.round_id, phase), None)
            return AverageFailed(str(err))
        contributors = tuple(p for p in act.weights if p not in set(done.excluded))
        total = total_weight(act.weights, contributors)
        self._result = done.result / total if total > 0 else None  # (N,): the token-weighted mean pseudo-gradient
        return Averaged(contributors)

    async def _fetch(self, act: FetchOuter, step: int) -> OuterEvent:
        self._result = None
        try_s = act.try_s if act.try_s is not None else self.replica_sync.averager.timeout_s
        with trio.move_on_after(try_s):
            try:
                summed = await self.replica_sync.fetch(step, act.round_id, act.weights)
            except AveragingError as err:
                return Fetched(False, str(err))
            # A proven result is a full round's: every participant's weight is in it.
            total = total_weight(act.weights, list(act.weights))
            if total <= 0:
                return Fetched(False, f"outer round {act.round_id} has no weighted participant")
            self._result = summed / total
        if self._result is None:
            return Fetched(False, f"no result within {try_s:g} s")
        return Fetched(True)

    async def _apply(self, act: ApplyOuter, step: int) -> OuterEvent:
        result = self._result
        if result is None:
            raise RuntimeError(f"outer step after step {step} without a result")
        async with self.compute:
            param_hash = await trio.to_thread.run_sync(self.worker.apply_outer, result, step + 1)
            self.replica_sync.commit(step)  # the compression's residual of this round is this replica's now
        # The stage's new shared state: report it (I2) at once, and checkpoint it when one is due.
        self.hashes.record(step, param_hash)
        self.link.beat_now()
        outer = self.worker.outer
        assert outer is not None
        await self.persistence.after_step(self.core.stage, self.worker, lambda: outer.anchor_applied, self.target_steps,
                                          span=self.worker.run.sync.inner_steps)
        return Installed(param_hash)
