"""One joined node: the trio adapter that builds the stage it serves, trains it, and keeps its heartbeat.

:class:`Node` holds what lasts for the node's life (the coordinator link, the membership view
(:mod:`membership`), its parameter hashes (:mod:`replica_hashes`), its reachability
(:mod:`relay_watch`), the attack of a test adversary (:mod:`adversary`)) and builds, for each stage the
coordinator gives it (:meth:`Node.build`), that stage's parts, which get their collaborators in their
constructors: the worker, the node core and the ticket record, integrity, the router and stage 0's
driver, the averager, the state sync and the finisher. :mod:`lifecycle` runs it.

Per step t: stage-0 replicas lease tickets and drive them through the pipeline (:mod:`driver`,
:mod:`router`); every replica long-polls the coordinator until t closes, which freezes the accounting
(stage → peer → tickets), and then finishes the step (:mod:`finishing`): each stage's participating
replicas sum their accumulated gradients with the collective (:mod:`averaging`), a replica the
accounting leaves out fetches the same result, and nobody applies the step until every stage has
averaged it in full (the commit barrier), so a replica that dies while any stage averages is redone,
never lost. Every replica applies the identical optimizer step, logs its parameter hash, and reports
it in its heartbeat, where its stage's replicas' hashes are compared (I2). Work for step t+1 that
arrives before t is applied is held (bounded) and released after.

In DiLoCo mode (``[sync] mode = "diloco"``) the core is an :class:`InnerStepCore`: each replica applies its
own inner steps, and every H steps :class:`~protolearn.node.outer_sync.OuterSync` runs the stage's outer
round. What the replica reports (hash, step), serves a joiner and checkpoints is then its state after the
last outer sync, the only state its stage's replicas share; its heartbeat carries its inner step beside it.
A (re)starting replica takes that state from the stage and trains on from the open step
(:meth:`Node.sync_state`).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import trio
from protolearn.node.adversary import Attack, parse_adversary
from protolearn.node.averaging import Averager
from protolearn.node.replica_sync import ReplicaSync
from protolearn.node.checkpoint import Snapshot
from protolearn.node.config import NodeConfig
from protolearn.node.compute_watch import ComputeWatch
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.core.balancer import Balancer
from protolearn.node.core.closed_step import CoreConfig, NodeCore
from protolearn.node.core.events import Synced
from protolearn.node.core.inner_step import InnerStepCore
from protolearn.node.core.routing import RouteCore
from protolearn.node.core.tickets import Tickets
from protolearn.node.driver import TicketDriver
from protolearn.node.errors import JoinError
from protolearn.node.finishing import Finisher
from protolearn.node.integrity import Integrity
from protolearn.node.join import resolve_device
from protolearn.node.membership import Membership
from protolearn.node.outbound import PASS_THROUGH
from protolearn.node.outer_sync import OuterSync
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.reachability import Reachability
from protolearn.node.relay_watch import RelayWatch
from protolearn.node.replica_hashes import ReplicaHashes
from protolearn.node.router import Router
from protolearn.node.state_sync import StateServer
from protolearn.node.step_timing import StepTimer
from protolearn.node.syncing import StageSync
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.boundary import OutputEvidence
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.collective.robust import Aggregation
from protolearn.protocol.states import NodeState
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.transport import Host
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import load_corpus

log = logging.getLogger("protolearn.node")
# Long-poll length of one wait_step request (the coordinator caps it at 30 s).
WAIT_POLL_S = 10.0


class Node:
    """One joined node: the trio adapter around its :class:`NodeCore`. Build and run it with :func:`run_node`."""

    def __init__(
        self, config: NodeConfig, host: Host, link: CoordinatorLink, joined: cm.JoinReply, run: RunConfig, progress: Progress,
        reachability: Reachability, *, clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.config = config
        self.host = host
        self.link = link
        self.run = run
        self.clock = clock
        self.run_hash = joined.run_hash
        self.stage = joined.stage  # the stage this node serves; the coordinator's choice is self.link.stage
        self.progress = progress
        self.view = Membership(joined.view_version, list(joined.members))
        self.heartbeat_s = joined.heartbeat_interval_s
        self.device = resolve_device(config.device)
        # Where each step's time goes (node/step_timing.py): one ``step_times`` event per step.
        self.timing = StepTimer(progress, clock)
        # Held for every compute step, and while a step is applied together with the applied count.
        self.compute = self.timing.limiter(trio.CapacityLimiter(1))
        # Times each forward, backward and optimizer step against this node's own medians (a hung device).
        self.compute_watch = ComputeWatch()
        self.last_loss: float | None = None
        self.target_steps = min(run.steps, config.max_steps) if config.max_steps else run.steps
        self.hashes = ReplicaHashes(link, progress, host.peer_id, applied=lambda: self.state_applied)
        self._first_logged = False
        self._moved_warned = False
        # Cancelled when the coordinator moves this node to a stage nobody works in: see _wait_closed.
        self._closing: trio.CancelScope | None = None
        self._leaving = False
        self._waiting = ""
        self.persistence = StagePersistence(config, run, progress, self.compute)
        self.core: NodeCore | None = None
        # Spot checks pick microbatches and checkers at random: seeded per node, and the seed is logged.
        self.integrity_seed = int(os.environ.get("PROTOLEARN_CHECK_SEED") or int.from_bytes(os.urandom(4), "big"))
        # Testing only: the attack this node makes (node/adversary.py), None for an honest node.
        self.attack = Attack(parse_adversary(config.adversary), progress) if config.adversary else None
        # A member's last connection closing restarts the tickets stage 0 had in flight through it.
        host.on_connection = self._on_connection
        # What the reachability check at the join found, and so the heartbeat's path.
        self.relay_watch = RelayWatch(host, config, progress, reachability, coordinator=link.peer)
        self.worker: StageWorker
        self.routes: RouteCore
        self.driver: TicketDriver
        self.router: Router
        self.averager: Averager
        self.replica_sync: ReplicaSync
        self.finisher: Finisher
        self.syncer: StageSync

    @property
    def state(self) -> NodeState:
        if self._leaving:
            return NodeState.LEAVING
        return self.core.state if self.core is not None else NodeState.SYNCING

    @property
    def applied(self) -> int:
        """Steps this node's stage has applied (0 before it is built)."""
        return self.core.applied if self.core is not None else 0

    @property
    def diloco(self) -> bool:
        return self.run.sync.diloco

    @property
    def state_applied(self) -> int:
        """The steps the state this replica shares with its stage is after: its applied steps, or in DiLoCo
        mode those of its last outer sync (what it reports, serves and checkpoints)."""
        if self.diloco and self.core is not None:
            outer = self.worker.outer
            return max(0, outer.anchor_applied) if outer is not None else 0  # -1 while a state is being installed
        return self.applied

    # -- set-up ------------------------------------------------------------------------------
    async def build(self, stage: int) -> None:
        """Build ``stage`` (again, after the coordinator moved this node) and serve its protocols."""
        self.core = None
        self._moved_warned = False
        self.stage = stage
        self.hashes.clear()
        run, attack = self.run, self.attack
        bf16 = self.config.bf16
        self.worker = await trio.to_thread.run_sync(
            lambda: attack.worker(run, stage, self.device, bf16_autocast=bf16) if attack else StageWorker(run, stage, self.device, bf16_autocast=bf16)
        )
        self.compute_watch.attach(self.worker)
        corpus = None
        if self.worker.first or self.worker.last:
            corpus = await trio.to_thread.run_sync(load_corpus, run.data)
            try:
                await self.link.check_corpus(corpus.fingerprint)
            except CoordinatorRefused as err:
                if err.code == "corpus_mismatch":
                    raise JoinError(err.detail) from None
                raise
        core_config = CoreConfig(
            microbatches_per_step=run.batch.microbatches_per_step, max_in_flight=self.config.max_in_flight,
            max_deferred=self.config.max_deferred, averaging_timeout_s=self.config.averaging_timeout_s,
        )
        core = (InnerStepCore(self.host.peer_id, stage, core_config, inner_steps=run.sync.inner_steps, steps=run.steps)
                if self.diloco else NodeCore(self.host.peer_id, stage, core_config))
        # One record per ticket (node/core/tickets.py), which routing, integrity and stage 0's driver share.
        tickets = Tickets()
        self.routes = RouteCore(tickets, Balancer(order=self.host.peer_id))
        outbound = attack.outbound(self.worker) if attack else PASS_THROUGH
        self.integrity = Integrity(
            self.host, run, self.worker, corpus, self.compute, tickets=tickets, outbound=outbound,
            replicas=lambda s: self.view.stage_peers(s), witnesses=self._witnesses, stage_of=lambda peer: self.view.stage_of(peer),
            report=self._integrity_report, timeout_s=self.config.request_timeout_s, seed=self.integrity_seed,
            checkable=(lambda step: step % run.sync.inner_steps == 0) if self.diloco else None,
        )
        # The driver starts tickets through the router built next (the closure reaches it when one starts).
        self.driver = TicketDriver(
            self.config, run, self.link, self.progress, accounting=core.accounting, routes=self.routes,
            start=lambda step, ticket, nonce: router.start_ticket(step, ticket, nonce), outbound=outbound, clock=self.clock,
        )
        router = self.router = Router(
            self.host, run, self.worker, corpus, core.accounting, self.compute, routes=self.routes, integrity=self.integrity,
            outbound=outbound, on_complete=self.driver.complete, on_peer_down=self.driver.peer_down if self.worker.first else None,
            send_timeout_s=self.config.request_timeout_s, clock=self.clock, timing=self.timing,
        )
        self.averager = Averager(self.host, stage, self.worker.numel, timeout_s=self.config.averaging_timeout_s,
                                 window=lambda: core.next_round, clock=self.clock,
                                 members=lambda: set(self.view.stage_peers(stage, live=False)),
                                 aggregation=Aggregation.from_config(run.integrity), cross_check=run.integrity.cross_check,
                                 part_filter=outbound.part_filter, on_reducer_fault=self.integrity.reducer_fault)
        self.averager.register()
        self.replica_sync = ReplicaSync(self.averager, run.sync.compression_spec, [tuple(p.shape) for p in self.worker.params],
                                        seed=run.seed, compute=self.compute)
        self.syncer = StageSync(
            self.config, self.host, self.link, self.worker, self.persistence, self.compute, self.progress,
            stage=stage, run_hash=self.run_hash, donors=lambda: [p for p in self.view.stage_peers(stage) if p != self.host.peer_id],
            say_waiting=self._say_waiting, clock=self.clock,
        )
        outer = None
        if isinstance(core, InnerStepCore):
            outer = OuterSync(core, self.worker, self.replica_sync, self.link, self.compute, self.progress, hashes=self.hashes,
                              persistence=self.persistence, target_steps=self.target_steps, ask_timeout_s=self.config.sync_timeout_s,
                              clock=self.clock)
        self.finisher = Finisher(
            core, self.worker, self.replica_sync, self.link, self.compute, self.progress,
            reported_hashes=self.syncer.reported_hashes, resync=self.resync, start_held=self.router.release, clock=self.clock,
            timing=self.timing, outer=outer,
        )
        StateServer(self.host, stage, self.run_hash, self._snapshot, members=lambda: set(self.view.stage_peers(stage, live=False))).register()
        self.core = core
        self._apply_view()
        self.progress.update(stage=stage, num_stages=self.worker.module.plan.num_stages, steps=self.target_steps)
        self.progress.event(
            "built", stage=stage, device=self.device, params=self.worker.numel, layers=list(self.worker.module.layers), check_seed=self.integrity_seed,
            precision=self.worker.precision,
        )

    async def _snapshot(self) -> Snapshot | None:
        core, outer = self.core, self.worker.outer
        if core is None or core.state is NodeState.SYNCING or (outer is not None and outer.anchor_applied < 0):
            return None
        # The applied count is read in the thread, under the compute lock the finisher applies steps under.
        snap = await trio.to_thread.run_sync(self.worker.shared_snapshot, lambda: core.applied, self.run.integrity.self_test, limiter=self.compute)
        self.hashes.served(snap.applied)
        return snap

    async def sync_state(self, open_step: int) -> None:
        """Take the stage's state (see :class:`~protolearn.node.syncing.StageSync`); the core counts it applied."""
        assert self.core is not None  # built
        self.worker.applied = -1  # weights being replaced: no spot check recomputes with them meanwhile
        self.replica_sync.reset()  # its residual and warm start belong to the state it had
        if self.diloco:
            # The stage's state after its last outer sync; this replica trains on from the open step.
            got, frontier = await self.syncer.sync_anchor(open_step)
            outer = self.worker.outer
            assert outer is not None
            self.worker.anchored(got, since_step=frontier)
            self.worker.applied = frontier
            if got > 0:
                self.hashes.record(got - 1, outer.anchor_hash)
            self.progress.event("anchor", applied=got, trains_from=frontier, hash=outer.anchor_hash)
            self.core.handle(Synced(frontier), self.clock())
            return
        applied = await self.syncer.sync(open_step)
        self.worker.applied = applied
        if applied > 0:
            # Report the installed state's hash at once, not only after the next applied step: a stage whose
            # replicas all just synced (and cannot apply yet) would otherwise report none, and every joiner
            # would wait for "its replicas' parameter hashes" forever.
            self.hashes.record(applied - 1, await trio.to_thread.run_sync(self.worker.state_hash, limiter=self.compute))
        self.core.handle(Synced(applied), self.clock())

    async def _witnesses(self, target: str, step: int, ticket: int, direction: str) -> list[str]:
        """The coordinator's draw of witnesses for a spot check of ``target`` (none when it refuses)."""
        try:
            return await self.link.witnesses(target, step, ticket, direction)
        except CoordinatorRefused as err:
            log.info("witness draw refused peer=%s code=%s reason=%s", target, err.code, err.detail)
            return []

    async def _integrity_report(self, target: str, reason: str, evidence: OutputEvidence | None, fault: ReducerFault | None = None) -> bool:
        """Send an integrity report; True when the coordinator banned ``target`` (this node then shuts
        it out at once, without waiting for the next heartbeat's ban list)."""
        try:
            reply = await self.link.integrity_report(target, reason, evidence, fault)
        except CoordinatorRefused as err:
            log.warning("integrity report refused peer=%s code=%s reason=%s", target, err.code, err.detail)
            return False
        self.progress.event("integrity_report", peer=target, evidence=evidence is not None, banned=reply.banned, reason=reply.reason)
        if reply.banned:
            self.progress.say(f"banned {target[-8:]}: {reply.reason}")
            self._shut_out(target, reply.reason)
        return reply.banned

    def _shut_out(self, peer: str, reason: str) -> None:
        """The coordinator banned ``peer``: refuse it, route around it, and leave it out of the round in
        flight at once (its record ends its role, so no wait on it outlasts that word)."""
        if self.host.is_banned(peer):
            return
        self.host.ban(peer, reason)
        if self.core is not None:
            self.routes.ban(peer)
            self.averager.peer_banned(peer, reason)

    def _apply_view(self) -> None:
        for m in self.view.members:
            if m.peer_id != self.host.peer_id and m.addrs:
                try:
                    self.host.add_peer_addrs(m.peer_id, m.addrs)
                except ProtocolError as err:
                    log.warning("ignored member address peer=%s reason=%s", m.peer_id, err.reason)
        self.host.retain_dial_failures({m.peer_id for m in self.view.members})  # one that left is dialled at once if it rejoins
        if self.stage + 1 < self.run.stages.num_stages:
            self.routes.next_peers = self.view.stage_peers(self.stage + 1)
        self.progress.update(peers=len(self.view.members) - 1)
        self._update_waiting()

    def _update_waiting(self) -> None:
        """Name, on the progress line, what training waits for when a stage has no replica."""
        if self.core is None or not self.state.live:
            return
        self._say_waiting(self.view.waiting_for(self.stage, self.run.stages.num_stages, self.link.stage_replicas))

    def _say_waiting(self, what: str) -> None:
        if what != self._waiting:
            self._waiting = what
            self.progress.update(waiting=what)
            if what:
                self.progress.event("waiting", reason=what)

    def _on_connection(self, peer: str, up: bool) -> None:
        """A member's last connection closed (it died or restarted): stage 0 restarts the tickets it
        had in flight through it at once, instead of when the coordinator's view drops the member."""
        if up or self.core is None or not self.worker.first:
            return
        stage = self.view.stage_of(peer)
        if stage == 1:
            self.driver.peer_down(peer)  # the tickets sent to it
        elif stage is not None and stage > 1:
            self.driver.member_left()  # stage 0 does not know which tickets went through it: all of them

    def _departed(self, old: Membership, gone: set[str]) -> None:
        """``gone`` left (in the ``old`` view, or named removed by a view delta, which names departures beyond
        this node's neighbourhood too): stage 0 restarts the tickets whose routes went through them
        (:meth:`Membership.broken_routes`; restarting them all once doubled the work of the step in which a
        stage-0 replica died)."""
        if not gone:
            return
        if not self.worker.first:
            self.driver.member_left()
            return
        down, every = old.broken_routes(gone)
        for peer in down:
            self.driver.peer_down(peer, departed=True)
        if every:
            self.driver.member_left()

    # -- heartbeat ---------------------------------------------------------------------------
    def make_heartbeat(self) -> cm.Heartbeat:
        path = self.relay_watch.path(self.view.neighbours(self.stage))
        if self.core is None:  # heartbeats start before the stage is built, so a slow start never expires
            return cm.Heartbeat(state=self.state, view_version=self.view.version, path=path, addrs=self.relay_watch.addrs())
        applied = self.state_applied
        if self.router.stats.first_at is not None and not self._first_logged:
            self._first_logged = True
            self.progress.event("first_microbatch", at=self.router.stats.first_at, stage=self.stage)
        return cm.Heartbeat(
            stage=self.stage,
            state=self.state,
            # Layer-tokens per second: the coordinator compares nodes across stages of different depth.
            throughput=self.router.stats.tokens * len(self.worker.module.layers) / self._elapsed(),
            queue_len=self.router.queue_len,
            step=applied - 1,
            param_hash=self.hashes.latest(applied),
            recent=self.hashes.recent(applied),
            checks=self.integrity.peer_checks(),
            loss=self.last_loss if self.last_loss is not None and math.isfinite(self.last_loss) else None,
            view_version=self.view.version,
            path=path,
            addrs=self.relay_watch.addrs(),
            inner_step=self.core.applied - 1 if self.diloco else -1,
        )

    def _elapsed(self) -> float:
        return max(1e-9, self.clock() - self.router.stats.started)

    def on_heartbeat(self, reply: cm.HeartbeatReply) -> None:
        for peer in reply.bans:
            self._shut_out(peer, "banned by the coordinator")
        if self.link.view_version != self.view.version:
            old = self.view
            self.view = Membership(self.link.view_version, list(self.link.members))
            if self.core is not None:
                removed = set(reply.removed) if reply.view_delta else set()
                self._departed(old, (old.live() - self.view.live()) | removed)
                self._apply_view()
        self._update_waiting()
        stranded = self._stranded()
        if reply.stage != self.stage and not self._moved_warned:
            self._moved_warned = True
            when = "now (nobody works in that stage)" if stranded else f"after step {self.applied}"
            log.warning("coordinator reassigned this node to stage %d; it moves %s", reply.stage, when)
        if stranded and self._closing is not None:
            self._closing.cancel()

    def _stranded(self) -> bool:
        """Whether the coordinator moved this node to a stage that nobody works in: then the open step cannot
        close until this node gets there (its tickets pass through that stage), so it moves at once."""
        dst, working = self.link.stage, self.link.stage_replicas
        return dst != self.stage and 0 <= dst < len(working) and working[dst] == 0

    # -- training ----------------------------------------------------------------------------
    async def train(self) -> bool:
        """Train until the run's last step (True) or until the coordinator moves this node (False)."""
        core = self.core
        assert core is not None  # built and synced
        self.link.beat_now()  # the coordinator counts this replica's share of tickets from the next lease
        self.progress.update(state=core.state.value, step=core.applied)
        self._update_waiting()
        while core.applied < self.target_steps:
            if self.link.stage != self.stage:
                # A step boundary: this replica's part in every closed step is done, so it can move.
                self.progress.event("moved", stage=self.stage, to=self.link.stage, applied=core.applied)
                return False
            step = core.applied
            self.timing.begin(step)
            revision = 1
            while revision:
                self.timing.phase("train")
                closed = trio.Event()
                async with trio.open_nursery() as nursery:
                    if self.worker.first:
                        nursery.start_soon(self.driver.drive, step, closed)
                    info = await self._wait_closed(step, revision)
                    # Not a cancel: a lease request cut off mid-flight would strand tickets until their lease expires.
                    closed.set()
                if info is None:
                    # Nothing of this step is applied here, and the stage it leaves keeps its other replicas
                    # (the coordinator never moves a stage's last one), which redo whatever it held.
                    self.progress.event("moved", stage=self.stage, to=self.link.stage, applied=core.applied, open_step=step)
                    return False
                self.timing.phase("averaging")
                # 0 once applied (or resynced); otherwise the step was reopened to redo tickets and closes again later.
                done = await self.finisher.finish(step, info)
                self.timing.phase("other")
                revision = done.revision
                if not revision and done.param_hash:
                    await self._after_apply(step, info, done.param_hash)
            self.timing.end(step)
        return True

    async def _after_apply(self, step: int, info: cm.StepInfo, param_hash: str) -> None:
        core = self.core
        assert core is not None
        if not self.diloco:  # in DiLoCo mode only outer syncs give a state to report and checkpoint (_outer_synced)
            self.hashes.record(step, param_hash)
            await self.persistence.after_step(self.stage, self.worker, lambda: core.applied, self.target_steps)
        if self.worker.last and info.loss is not None:
            self.last_loss = info.loss
        tps = self.router.stats.tokens / self._elapsed()
        self.progress.update(state=core.state.value, step=step + 1, loss=info.loss, tokens_per_s=tps, in_flight=core.accounting.num_in_flight)

    async def _wait_closed(self, step: int, min_revision: int = 1) -> cm.StepInfo | None:
        """The step's close, or None once the coordinator has moved this node to a stage nobody works in
        (:meth:`_stranded`): that step cannot close before this node moves, so waiting would never end."""
        try:
            with trio.CancelScope() as self._closing:
                while not self._stranded():
                    try:
                        info = await self.link.wait_step(step, min_revision=min_revision, timeout_s=WAIT_POLL_S)
                    except ProtocolError as err:
                        log.warning("wait_step failed step=%d reason=%s", step, err.reason)
                        await trio.sleep(1.0)
                        continue
                    if info.closed:
                        return info
            return None
        finally:
            self._closing = None

    async def resync(self, step: int) -> None:
        """This replica fell behind (it could not get step ``step``'s result): take a live replica's state."""
        assert self.core is not None
        self.core.start_syncing()
        self.progress.update(state=NodeState.SYNCING.value)
        self.progress.event("resync", step=step)
        await trio.to_thread.run_sync(self.worker.zero_grads, limiter=self.compute)
        await self.sync_state(self.link.step)
        self.progress.update(state=self.core.state.value, step=self.core.applied)

    async def leave(self, reason: str) -> None:
        self._leaving = True
        with trio.CancelScope(shield=True), trio.move_on_after(5.0):
            try:
                released = await self.link.leave(reason)
                self.progress.event("left", reason=reason, released=released)
            except ProtocolError as err:
                log.warning("leave failed reason=%s", err.reason)

    async def at_leave(self) -> None:
        """Write the stage's checkpoint as the node leaves (a built, synced stage only)."""
        core = self.core
        if core is None or core.state is NodeState.SYNCING:
            return
        await self.persistence.at_leave(self.stage, self.worker, lambda: self.state_applied)
