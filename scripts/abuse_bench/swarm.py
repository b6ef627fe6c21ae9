"""A member of the bench's swarm: one identity that joins, heartbeats and trains as a node does, without a model.

A :class:`Replica` is what a node is to the coordinator and to its stage. It joins with a
:class:`~protolearn.node.coordinator_link.CoordinatorLink`, heartbeats, and finishes every closed step with the
node's own :class:`~protolearn.node.core.closed_step.NodeCore` and :class:`~protolearn.node.finishing.Finisher`
over the real collective :class:`~protolearn.node.averaging.Averager` (the run's aggregation and cross-check),
exactly as :meth:`protolearn.node.node.Node.train` does: wait for the step to close, finish it, and if it
reopened, wait for it to close again. In stage 0 it leases tickets and carries each to a live stage-1 replica of
its view (not those the lease reply says to avoid, and suspects last), then completes it with that replica's
signed ack; in the last stage it answers that exchange. The model and that exchange are stand-ins
(:mod:`.stand_ins`), so every applied update can be checked: the step's every ticket, once (:meth:`Replica.outcome`).

An attacker is a replica that lies: its :class:`Lies` rewrite its heartbeats and the collective messages it
sends (everything else it does as an honest replica would, so it stays a member the coordinator waits for).
A stage-0 replica leases tickets only up to :attr:`Replica.lease_through` (None: any), so the bench can time
one training step at a time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from protolearn.node.averaging import Averager
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.core.closed_step import CoreConfig, NodeCore
from protolearn.node.core.events import Synced
from protolearn.node.errors import Banned
from protolearn.node.finishing import Finisher
from protolearn.node.progress import Progress
from protolearn.node.replica_sync import ReplicaSync
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.boundary import boundary_statement, frame_digest, inputs_digest
from protolearn.protocol.collective import Aggregation
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import COLLECTIVE, ResultServed
from protolearn.protocol.states import NodeState
from protolearn.protocol.wire import Message

from abuse_bench.stand_ins import PIPELINE, TicketDone, TicketWork, VectorWorker, boundary_frames, ticket_loss

log = logging.getLogger("protolearn.bench")
LAST_STAGE = 1  # the demo run has two stages
# As a node: the length of one "has the step closed?" long poll, and of a round's hard deadline.
WAIT_POLL_S = 10.0
AVERAGING_TIMEOUT_S = 120.0
# Heartbeats a joiner sends "syncing" before it trains (a node downloads its stage's state meanwhile).
SYNC_BEATS = 2
LEASE_TICKETS = 2
# As the node's lease core (node/core/leasing.py): ask again this soon while the step is open, this late once the
# coordinator answers with the next step (this one closed, and may only reopen).
LEASE_POLL_S = 0.05
CLOSED_POLL_S = 0.25


class Lies:
    """What a member says other than the truth. This one is honest; an attack overrides what it lies about."""

    def heartbeat(self, hb: cm.Heartbeat) -> cm.Heartbeat:
        return hb

    def collective(self, me: Replica, peer: str, msg: Message) -> Message:
        """The collective message ``me`` sends ``peer`` instead of ``msg`` (a part header, or an answer to a
        result request: an answer that is no longer :class:`ResultServed` sends no result after it)."""
        return msg


HONEST = Lies()


@dataclass(frozen=True)
class Outcome:
    """How a replica finished one step: ``how`` is "applied", "resync" or "skip"."""

    step: int
    how: str
    param_hash: str
    update_ok: bool  # the update it applied is the step's every ticket, once
    closings: int  # how many times the step closed before it committed (1: it never reopened)


class _Quiet(Progress):
    """The node's progress display without a terminal or a file: the events are kept, for the bench to read."""

    def __init__(self, name: str) -> None:
        super().__init__(log_path=None, name=name, live=False)  # type: ignore[arg-type]
        self.events: list[tuple[str, dict]] = []

    def event(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)

    def say(self, line: str) -> None:
        pass


class _RoundsNoted:
    """The averager as the finisher sees it, noting each round's weights (a lie re-signs statements of the round)."""

    def __init__(self, averager: Averager) -> None:
        self._averager = averager
        self.weights: dict[int, dict[str, float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._averager, name)

    async def run_round_detailed(self, round_id: int, weights: dict[str, float], vector: Any, **kw: Any) -> Any:
        self.weights[round_id] = dict(weights)
        return await self._averager.run_round_detailed(round_id, weights, vector, **kw)


class _LyingHost:
    """The host as a lying replica's averager sees it: each collective message it sends passes its :class:`Lies` first."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self._host = replica.host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    @asynccontextmanager
    async def open_stream(self, peer: str, name: str, **kw: Any) -> AsyncIterator[Any]:
        async with self._host.open_stream(peer, name, **kw) as s:
            yield _LyingStream(s, self._replica, peer) if name == COLLECTIVE else s

    def serve_stream(self, name: str, handler: Any, **kw: Any) -> None:
        """Its answers lie too (a late probe is answered with a fin)."""
        if name == COLLECTIVE:
            inner = handler

            async def handler(peer: str, s: Any) -> None:
                await inner(peer, _LyingStream(s, self._replica, peer))

        self._host.serve_stream(name, handler, **kw)


class _LyingStream:
    def __init__(self, stream: Any, replica: Replica, peer: str) -> None:
        self._s, self._replica, self._peer = stream, replica, peer
        self._mute = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    async def send(self, msg: Any, **kw: Any) -> None:
        said = self._replica.lies.collective(self._replica, self._peer, msg)
        self._mute = isinstance(msg, ResultServed) and not isinstance(said, ResultServed)
        await self._s.send(said, **kw)

    async def send_tensor(self, frame: Any, **kw: Any) -> None:
        if not self._mute:
            await self._s.send_tensor(frame, **kw)


class Replica:
    """One member of the bench's swarm (see the module docstring)."""

    def __init__(self, host: Any, coordinator: str, run: Any, *, name: str, numel: int, throughput: float = 100.0,
                 lies: Lies = HONEST, state: NodeState | None = None) -> None:
        """``state``: the state it heartbeats whatever it does (an attacker that never serves: ``syncing``)."""
        self.host = host
        self.run = run
        self.name = name
        self.numel = numel
        self.throughput = throughput
        self.lies = lies
        self.fixed_state = state
        self.link = CoordinatorLink(host, coordinator)
        self.me = host.peer_id
        self.stage = -1
        self.lease_through: int | None = None
        # How soon it asks again once the step closed (an attacker eager for the next step's tickets: LEASE_POLL_S).
        self.closed_poll_s = CLOSED_POLL_S
        self.banned = ""
        self.resyncs: list[int] = []
        # The stage-mates a resync may download from (the target's honest replicas; None: recompute the state).
        self.donors: Callable[[], list[Replica]] | None = None
        # (step, ticket) -> the completion it sent (its last stage's ack over that lease's nonce), the latest few
        self.completed: dict[tuple[int, int], cm.Complete] = {}
        self._outcomes: dict[int, Outcome] = {}
        self._changed = trio.Event()
        self._hashes: dict[int, str] = {}
        self._lease_open = trio.Event()
        self.progress = _Quiet(name)
        self._beats = 0
        self._beat = trio.Event()

    # -- joining ------------------------------------------------------------------------------
    async def join(self) -> int:
        """Join and build the stage the coordinator assigned (its state: the stage's, at the frontier)."""
        addrs = [a.rsplit("/p2p/", 1)[0] for a in self.host.addrs()]
        reply = await self.link.join(cm.Join(addrs=addrs, throughput=self.throughput, name=self.name))
        self.stage = reply.stage
        b = self.run.batch.microbatches_per_step
        self.worker = VectorWorker(self.stage, self.numel, b)
        self.core = NodeCore(self.me, self.stage, CoreConfig(microbatches_per_step=b, max_in_flight=8, max_deferred=16,
                                                             averaging_timeout_s=AVERAGING_TIMEOUT_S))
        self._dial_book()
        integrity = self.run.integrity
        averager = Averager(_LyingHost(self) if self.lies is not HONEST else self.host, self.stage, self.numel, timeout_s=AVERAGING_TIMEOUT_S,
                            window=lambda: self.core.next_round, members=self._stage_peers,
                            aggregation=Aggregation.from_config(integrity), cross_check=integrity.cross_check)
        averager.register()
        self.averager = _RoundsNoted(averager)
        # The node's replica sync, under the run's [sync] compression (its stand-in model is one flat tensor).
        sync = ReplicaSync(self.averager, self.run.sync.compression_spec, [(self.numel,)], seed=self.run.seed)  # type: ignore[arg-type]
        self.finisher = Finisher(self.core, self.worker, sync, self.link, trio.CapacityLimiter(1), self.progress,
                                 reported_hashes=self._reported_hashes, resync=self._resync, start_held=lambda payloads: None)
        if self.stage == LAST_STAGE:
            self.host.serve(PIPELINE, self._work, request_type=TicketWork)
        return self.stage

    def _stage_peers(self) -> set[str]:
        return {m.peer_id for m in self.link.members if m.stage == self.stage} | {self.me}

    # -- running ------------------------------------------------------------------------------
    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat, train and (stage 0) lease until cancelled, or until the coordinator bans this member."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.link.heartbeat_loop, self._heartbeat, self._on_heartbeat)
                await self._sync()
                nursery.start_soon(self._train)
                if self.stage == 0:
                    nursery.start_soon(self._drive)
                task_status.started()
        except* Banned as group:
            self.banned = str(group.exceptions[0])

    async def _sync(self) -> None:
        """Take the stage's state at the frontier, after :data:`SYNC_BEATS` heartbeats "syncing", as a joiner that
        downloads it does (so its stage-mates know it, and where to dial it, before it carries a ticket)."""
        while self._beats < SYNC_BEATS:
            await self._beat.wait()
        frontier = self.link.step
        self.worker.install(frontier)
        self.core.handle(Synced(frontier), trio.current_time())
        self.link.beat_now()

    def _heartbeat(self) -> cm.Heartbeat:
        applied = self.core.applied
        state = self.fixed_state or self.core.state
        hb = cm.Heartbeat(stage=self.stage, state=state.value, throughput=self.throughput, step=applied - 1,
                          param_hash=self._hashes.get(applied - 1, ""))
        return self.lies.heartbeat(hb)

    def _on_heartbeat(self, reply: cm.HeartbeatReply) -> None:
        for peer in reply.bans:
            self.averager.peer_banned(peer, "banned by the coordinator")
        self._dial_book()
        self._beats += 1
        self._beat.set()
        self._beat = trio.Event()

    def _dial_book(self) -> None:
        """Where to dial the members of the view (as the node does when its view changes)."""
        for m in self.link.members:
            if m.peer_id != self.me and m.addrs:
                self.host.add_peer_addrs(m.peer_id, m.addrs)

    async def _train(self) -> None:
        while True:
            step = self.core.applied
            revision, closings = 1, 0
            while revision:
                info = await self._wait_closed(step, revision)
                closings += 1
                done = await self.finisher.finish(step, info)
                revision = done.revision
            if step in self.resyncs:
                outcome = Outcome(step, "resync", "", False, closings)
            elif step in self.worker.updates:
                self._hashes[step] = done.param_hash
                outcome = Outcome(step, "applied", done.param_hash, self.worker.update_ok(step), closings)
            else:
                outcome = Outcome(step, "skip", done.param_hash, False, closings)
            self._outcomes[step] = outcome
            self._changed.set()
            self._changed = trio.Event()

    async def _wait_closed(self, step: int, revision: int) -> cm.StepInfo:
        while True:
            try:
                info = await self.link.wait_step(step, min_revision=revision, timeout_s=WAIT_POLL_S)
            except ProtocolError as err:
                log.warning("%s: wait_step failed step=%d reason=%s", self.name, step, err.reason)
                await trio.sleep(1.0)
                continue
            if info.closed:
                return info

    async def _reported_hashes(self, step: int) -> dict[str, str]:
        try:
            reported = await self.link.stage_hashes(self.stage)
        except ProtocolError:
            return {}
        return {p.peer_id: p.hash for p in reported if p.step == step and p.hash and p.peer_id != self.me}

    async def _resync(self, step: int) -> None:
        """A resync takes the stage's state from its majority: here, the right updates of every committed step."""
        self.resyncs.append(step)
        self.core.start_syncing()
        try:
            await self.link.stage_hashes(self.stage)  # the frontier
        except ProtocolError:
            pass
        frontier = max(self.link.step, step)
        donor = next((d for d in (self.donors() if self.donors else []) if d.stage == self.stage and d.core.applied == frontier), None)
        if donor is not None:
            self.worker.copy_from(donor.worker, frontier)
        else:
            self.worker.install(frontier)
        self.core.handle(Synced(frontier), trio.current_time())

    async def outcome(self, step: int) -> Outcome:
        """How this replica finished ``step``, once it has."""
        while step not in self._outcomes:
            await self._changed.wait()
        return self._outcomes[step]

    # -- stage 0: leasing and carrying tickets -----------------------------------------------------
    def allow_leases(self, through: int | None) -> None:
        self.lease_through = through
        self._lease_open.set()
        self._lease_open = trio.Event()

    def _may_lease(self, step: int | None = None) -> bool:
        through = self.lease_through
        return through is None or (self.core.applied <= through and (step is None or step <= through))

    async def _drive(self) -> None:
        while True:
            if not self._may_lease():
                await self._lease_open.wait()
                continue
            try:
                reply = await self.link.lease(LEASE_TICKETS)
            except ProtocolError as err:
                log.info("%s: lease failed: %s", self.name, err.reason)
                await trio.sleep(0.5)
                continue
            if not reply.indices:
                await trio.sleep(self.closed_poll_s if reply.step > self.core.applied else LEASE_POLL_S)
                continue
            if not self._may_lease(reply.step):
                await self._release(reply.step, reply.indices)
                continue
            for index, nonce in zip(reply.indices, reply.nonces, strict=True):
                await self.carry(reply.step, index, nonce, set(reply.avoid), set(reply.suspects))

    async def _release(self, step: int, indices: list[int]) -> None:
        try:
            await self.link.release(step, indices)
        except ProtocolError as err:
            log.info("%s: release failed: %s", self.name, err.reason)

    def targets(self, step: int, index: int, avoid: Collection[str] = (), suspects: Collection[str] = ()) -> list[str]:
        """The live last-stage replicas of this replica's view to try for ticket (step, index), none it must avoid and
        suspects last: the first is ``(step + index)``-th in turn, so a step's tickets spread over them all (as the
        node's balancer spreads them over replicas of equal speed) and every one of them is a participant."""
        live = sorted(m.peer_id for m in self.link.members if m.stage == LAST_STAGE and NodeState(m.state).live
                      and m.peer_id not in avoid and m.peer_id not in self.link.bans)
        turn = (step + index) % len(live) if live else 0
        live = live[turn:] + live[:turn]
        return [p for p in live if p not in suspects] + [p for p in live if p in suspects]

    async def work(self, peer: str, step: int, index: int, nonce: bytes, *, output: bool = False) -> TicketDone:
        """Have last-stage replica ``peer`` carry ticket (step, index): its signed ack (and backward output)."""
        return await self.host.request(peer, PIPELINE, TicketWork(step=step, index=index, route=[self.me, peer], nonce=nonce, output=output),
                                       TicketDone, timeout=10)

    async def carry(self, step: int, index: int, nonce: bytes, avoid: Collection[str] = (), suspects: Collection[str] = ()) -> bool:
        """Carry one leased ticket through a last-stage replica and complete it; False if nobody took it or it was refused."""
        self.worker.compute(step, index)
        for peer in self.targets(step, index, avoid, suspects):
            try:
                done = await self.work(peer, step, index, nonce)
            except ProtocolError as err:
                log.info("%s: ticket (%d,%d) not carried by %s: %s", self.name, step, index, peer, err.reason)
                continue
            try:
                await self.link.complete(step, index, [self.me, peer], done.loss, done.ack, nonce)
                self.completed[(step, index)] = cm.Complete(step=step, index=index, route=[self.me, peer], loss=done.loss, ack=done.ack, nonce=nonce)
                for old in [k for k in self.completed if k[0] < step - 4]:
                    del self.completed[old]
                return True
            except CoordinatorRefused as err:
                log.info("%s: completion of (%d,%d) refused: %s", self.name, step, index, err.reason)
                if err.code in ("bad_route", "bad_ack", "bad_loss"):  # as the node's lease core: redo it now
                    await self._release(step, [index])
                return False
            except ProtocolError as err:
                log.info("%s: completion of (%d,%d) unanswered: %s", self.name, step, index, err.reason)
                return False
        await self._release(step, [index])
        return False

    # -- the last stage: carrying a ticket ----------------------------------------------------------
    async def _work(self, peer: str, msg: TicketWork) -> TicketDone:
        if self.stage != LAST_STAGE or msg.route != [peer, self.me]:
            raise ProtocolError(peer, f"ticket ({msg.step},{msg.index}): route {msg.route} is not from the sender to this last-stage replica")
        self.worker.compute(msg.step, msg.index)
        loss = ticket_loss(msg.index)
        run_hash = self.link.joined.run_hash if self.link.joined is not None else ""
        ack = self.host.sign(ack_statement(run_hash, msg.step, msg.index, msg.route, loss, msg.nonce))
        signature = b""
        if msg.output:
            act, grad = await trio.to_thread.run_sync(boundary_frames, msg.step, msg.index, self.boundary_shape)
            statement = boundary_statement(run_hash, msg.step, msg.index, "bwd", self.stage, inputs_digest([act]), frame_digest(grad))
            signature = self.host.sign(statement)
        return TicketDone(loss=loss, ack=ack, output_signature=signature)

    @property
    def boundary_shape(self) -> tuple[int, int, int]:
        b = self.run.batch
        return (b.microbatch_size, b.seq_len, self.run.model.d_model)
