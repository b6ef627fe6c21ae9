"""The coordinator service: a libp2p host in front of the sans-IO core, with SQLite persistence.

:func:`serve` opens the data dir (identity key + ``coordinator.sqlite``), refuses a run that differs
from the one persisted there, restores the state, starts a host that answers
``/protolearn/coordinator/1.0.0`` and calls ``task_status.started(Running(...))`` once listening.

Each request is handled by :meth:`CoordinatorCore.handle` with the wall clock (persisted times stay
meaningful across restarts), then every change is written to SQLite before the reply goes out, so a
reply a node has seen is never lost to a SIGKILL. A refusal is logged with the peer, the request and
the reason and goes back as an ``ErrorReply``. Like the transport's rejections, a peer's first refusal
in an interval is written in full and the rest go into one summary line with their count
(:mod:`protolearn.protocol.log_digest`), so a flooding peer cannot fill the disk. ``WaitStep`` is a
long poll: it waits on an event that is set whenever a step closes, reopens or commits, bounded by
the request's timeout (≤ 30 s), in one of ``max_concurrent_waits`` slots; when they are all taken, the
busiest waiting peer's oldest poll is answered early for a peer that waits on less
(``coordinator/core/wait_slots.py``), and only otherwise is the poll refused ``busy``. A housekeeping task expires members and leases and rebalances; the
host tells the core when a member's connection closes, so a dead member's leases end after a short
grace instead of at their expiry. Banned peers are handed to the host's gate, which refuses them at
connection time.

Reachability (``coordinator/core/reachability.py`` decides): a ``ReachabilityRequest`` is dialled back from
a second host, the *checker* (a throwaway identity on 127.0.0.1, opened at start-up), never over the
connection the node opened, since that one reaches the node whatever its NAT does. The dials run in
the request's own handler task under a semaphore of ``MAX_CHECKS``, so heartbeats are served
meanwhile; each dial has its own deadline and the checker drops its connection to the node after.
With ``relay=True`` the main host also relays for private nodes and offers itself as their relay.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.reachability import BUSY, DIAL_TIMEOUT_S, MAX_CHECK_WAITERS, MAX_CHECKS, SLOT_WAIT_S, decide, dial_targets
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.wait_slots import WaitSlots
from protolearn.coordinator.errors import Refusal, RunMismatch
from protolearn.coordinator.metrics import metrics_registry, serve_metrics
from protolearn.coordinator.store import DB_FILE, Store
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError
from protolearn.protocol.identity import Identity, load_or_create_identity
from protolearn.protocol.interfaces import parse_announce
from protolearn.protocol.log_digest import LogDigest, Summary
from protolearn.protocol.link import LinkSpec
from protolearn.protocol.transport import FramedStream, Host, RelayLimits, TransportConfig, open_host
from protolearn.protocol.wire import ErrorReply, Message

log = logging.getLogger("protolearn.coordinator")

# A member's heartbeat stream (cm.BEATS) is closed once silent this long past its expiry (it expired anyway).
BEAT_IDLE_SLACK_S = 10.0
# Heartbeat streams open at once from peers that are not live members (their beats are refused anyway).
UNKNOWN_BEAT_STREAMS = 16
# Heartbeat telemetry (last seen, throughput) is written this often rather than on every heartbeat.
SOFT_PERSIST_S = 5.0
# Streams open at once from peers that are not live members (joins, status readers), shared by all of them.
UNKNOWN_STREAMS = 256
# Inbound handshakes in flight at once (protocol/transport/inbound.py): a swarm reconnecting after a restart
# queues in its TCP backlog and retries, rather than every handshake slowing all the others.
PENDING_CONNECTIONS = 256
# Where the reachability checker listens: it only dials out, and nobody needs to reach it.
CHECKER_LISTEN = "/ip4/127.0.0.1/tcp/0"
# Checker connections waiting to be closed after their check replied (past that, a check closes its own).
HANG_UP_QUEUE = 256
# Hanging up at once cuts libp2p's identify exchange short, and libp2p logs each such cut as an ERROR.
HANG_UP_DELAY_S = 0.5

REQUEST_TYPES: tuple[type[Message], ...] = (
    cm.Join,
    cm.Heartbeat,
    cm.Lease,
    cm.Release,
    cm.Complete,
    cm.WaitStep,
    cm.Redo,
    cm.Averaged,
    cm.OuterReady,
    cm.CorpusCheck,
    cm.Report,
    cm.WitnessDraw,
    cm.IntegrityReport,
    cm.Leave,
    cm.StatusRequest,
    cm.StageHashesRequest,
    cm.MembersRequest,
    cm.ReachabilityRequest,
)


@dataclass
class Running:
    """What :func:`serve` reports once it listens."""

    peer_id: str
    addrs: list[str]
    metrics_port: int | None
    core: CoordinatorCore
    host: Host
    # Where the coordinator keeps its state (and the finished run's model: protolearn/cli/final_model.py).
    data_dir: Path
    # The host that dials reachability checks back (its peer ID is not the coordinator's).
    checker: Host | None = None


def open_state(run: Any, data_dir: Path, settings: CoordinatorSettings, now: float) -> tuple[Store, CoordinatorCore, bool]:
    """Open the store, check the run against the persisted one, and build the restored core."""
    info = RunInfo.from_run(run)
    store = Store(data_dir)
    persisted = store.get_meta("run_hash")
    if persisted is not None and persisted != info.run_hash:
        name = store.get_meta("run_name") or "?"
        store.close()
        raise RunMismatch(
            f"data dir {data_dir} holds run '{name}' (hash {persisted[:12]}), not the given run '{info.name}' "
            f"(hash {info.run_hash[:12]}); use another --data-dir or the original --config"
        )
    identity = load_or_create_identity(Path(data_dir))
    # Ed25519 signatures are deterministic: the same key and run give the same nonce key after a restart,
    # and nobody without the coordinator's key can compute it.
    nonce_key = hashlib.sha256(identity.sign(b"protolearn/lease-nonce-key/1\x00" + info.run_hash.encode())).digest()
    core = CoordinatorCore(info, settings, peer_id=identity.peer_id, started_at=now, nonce_key=nonce_key)
    resumed = persisted is not None
    if resumed:
        core.restore(**store.load(), now=now)
    else:
        store.set_meta("run_hash", info.run_hash)
        store.set_meta("run_name", info.name)
        store.set_meta("run_toml", info.run_toml)
    return store, core, resumed


def persisted_run_toml(data_dir: Path) -> str | None:
    """The run TOML a data dir was started with, or None for a fresh dir."""
    if not (Path(data_dir) / DB_FILE).exists():
        return None
    store = Store(data_dir)
    try:
        return store.get_meta("run_toml")
    finally:
        store.close()


class _Service:
    def __init__(
        self, core: CoordinatorCore, store: Store, host: Host, clock: Callable[[], float],
        *, checker: Host | None = None, relay: bool = False, announce: Sequence[str] = (),
    ) -> None:
        self.core = core
        self.store = store
        self.host = host
        self.clock = clock
        # The host that dials reachability checks back (None: every check is "unknown"), and whether the
        # main host relays (then it is the first relay offered).
        self.checker = checker
        self.relay = relay
        # Full addresses (with /p2p/) the operator announced: offered first to nodes that need a relay.
        self.announce = list(announce)
        self._check_slots = trio.Semaphore(MAX_CHECKS)
        self._checks_queued = 0  # running or waiting for a slot
        # Closing a libp2p connection takes ~200 ms (yamux), far longer than the dial: the checker drops
        # its connections after the reply, in :meth:`checker_cleanup`.
        self._hang_up, self._hang_ups = trio.open_memory_channel[tuple[str, float]](HANG_UP_QUEUE)
        self._changed = trio.Event()
        self._closed = trio.Event()  # a member's connection closed (housekeeping)
        self._seen = self._progress()
        # The long polls' slots (coordinator/core/wait_slots.py), and each waiting poll's scope, to answer it early.
        self._slots = WaitSlots(core.settings.max_concurrent_waits)
        self._waits: dict[int, trio.CancelScope] = {}
        # Leases and DiLoCo arrivals held for an answer (at most ``max_concurrent_waits``; past that they answer at once).
        self._waiting = 0
        # Per peer, the wake-up of its held lease: any progress (a ticket freed, the step closed or committed), or its
        # own completion or release, which may bring it under its share (its own news wakes no one else's).
        self._lease_waits: dict[str, trio.Event] = {}
        # (request kind, code, reason) of refusals, logged per peer and interval like the host's rejections.
        self._refusals: LogDigest[tuple[str, str, str]] = LogDigest(
            interval_s=host.config.rejection_log_interval_s, max_peers=host.config.rejection_log_max_peers,
        )
        self.sync_bans()

    def _progress(self) -> tuple[int, int, int, int, int, bool]:
        """(open step, last closed step's revision, last committed step, outer decisions taken, tickets freed, whether
        the run started: core/gathering.py): long polls wake when it changes."""
        led = self.core.ledger
        closed = led.closed.get(led.step - 1)
        outer = self.core.outer.version if self.core.outer is not None else 0
        return led.step, closed.revision if closed is not None else 0, led.committed_through, outer, led.frees, self.core.gathering.started

    def sync_bans(self) -> None:
        """Refuse banned peers at connection time once their ban is ``ban_notice_s`` old. Until then each
        request of theirs is refused with the ban's reason, so a banned node can say why it stopped."""
        now = self.clock()
        for peer, ban in self.core.verdicts.bans.items():
            if now - ban.at >= self.core.settings.ban_notice_s and not self.host.is_banned(peer):
                self.host.ban(peer, ban.reason)

    def commit(self, *, soft: bool = False) -> None:
        """Persist, gate new bans, and wake long polls if a step closed, reopened or committed."""
        self.store.apply(self.core.drain(soft=soft))
        self.sync_bans()
        seen = self._progress()
        if seen != self._seen:
            self._seen = seen
            self._changed.set()
            self._changed = trio.Event()
            for wake in self._lease_waits.values():
                wake.set()

    def connection_changed(self, peer: str, up: bool) -> None:
        """The host's connection callback: a closed connection may commit the step (wake the long polls), and
        housekeeping ends its leases when the grace is over (:meth:`housekeeping`)."""
        self.core.connection_changed(peer, up, self.clock())
        if not up:
            self.commit()
            self._closed.set()

    async def on_request(self, peer: str, msg: Message) -> Message:
        try:
            if isinstance(msg, cm.WaitStep):
                return await self._wait(peer, msg)
            if isinstance(msg, cm.OuterReady):
                return await self._outer_wait(peer, msg)
            if isinstance(msg, cm.Lease) and msg.wait_s > 0:
                return await self._lease_wait(peer, msg)
            if isinstance(msg, cm.ReachabilityRequest):
                reply: Message = await self._check_reachability(peer, msg)
            else:
                if isinstance(msg, cm.Join):
                    seen = self.host.observed_addr(peer)
                    reply = self.core.handle(peer, msg, self.clock(), connections=self.host.num_connections(peer),
                                             ip=None if seen is None else seen[0])
                else:
                    reply = self.core.handle(peer, msg, self.clock())
                    if isinstance(msg, (cm.Complete, cm.Release)) and peer in self._lease_waits:
                        self._lease_waits[peer].set()
        except Refusal as r:
            write, due = self._refusals.note(peer, r.code, (msg.KIND, r.code, r.reason), self.host.clock())
            _log_refusal_summaries(due)
            if write:
                log.warning("refused peer=%s request=%s code=%s reason=%s", peer, msg.KIND, r.code, r.reason)
            self.commit()
            raise
        self.commit()
        return reply

    async def on_beats(self, peer: str, s: FramedStream) -> None:
        """A member's heartbeat stream: each Heartbeat is answered as the request would be (a refusal as its
        ErrorReply), until the member closes the stream or stays silent past its expiry."""
        while True:
            try:
                msg = await s.receive(cm.Heartbeat, timeout=self.core.pacing.expiry_s + BEAT_IDLE_SLACK_S)
                try:
                    reply: Message = await self.on_request(peer, msg)
                except Refusal as r:
                    reply = ErrorReply(code=type(r).__name__, reason=str(r))
                await s.send(reply)
            except (PeerTimeout, PeerUnavailable) as err:  # silent past its expiry, or gone: nothing to refuse
                log.info("heartbeat stream ended peer=%s reason=%s", peer, err.reason)
                return

    async def _wait(self, peer: str, msg: cm.WaitStep) -> cm.StepInfo:
        self.core.check_wait(peer, msg, self.clock())
        taken = self._slots.take(peer, trio.current_time())
        if taken is None:
            raise self.core.admission.refuse("busy", "too many waiting requests; retry shortly")
        if taken.ended is not None:  # the slot was the busiest waiting peer's: that wait is answered now
            ended = self._waits.pop(taken.ended, None)
            if ended is not None:
                ended.cancel()
        scope = self._waits[taken.token] = trio.CancelScope()
        try:
            with scope, trio.move_on_after(msg.timeout_s):
                while True:
                    info = self.core.step_info(msg.step, msg.min_revision)
                    if _answered(msg, info):
                        return info
                    await self._changed.wait()
            return self.core.step_info(msg.step, msg.min_revision)
        finally:
            self._waits.pop(taken.token, None)
            self._slots.release(taken.token)

    async def _lease_wait(self, peer: str, msg: cm.Lease) -> cm.LeaseReply:
        """A lease that finds no ticket free waits (up to ``msg.wait_s``) for one to free: a lease that ends or runs
        out, a departure, a redo (``TicketLedger.frees``). It answers empty as soon as the open step changes (it closed
        or reopened: the node's next lease is about another step). Before, a stage-0 replica asked again after a
        back-off of up to 2 s (node/core/leasing.py), and the tickets a dead replica held waited that long for it."""
        reply = self._lease(peer, msg)
        if reply.indices or reply.held or peer in self._lease_waits or self._waiting >= self.core.settings.max_concurrent_waits:
            return reply  # (one held request per peer: more from one identity are answered at once)
        step, t0 = reply.step, trio.current_time()
        self._waiting += 1
        wake = trio.Event()
        try:
            with trio.move_on_after(msg.wait_s):
                while not (reply.indices or reply.held) and self.core.ledger.step == step:
                    wake = self._lease_waits[peer] = trio.Event()  # (an earlier held request of its own waits out its time)
                    # Also asks again after relapse_wait_s: a lease that lapsed on this peer comes back to it only then,
                    # if nobody else took it, and no change wakes it for that.
                    with trio.move_on_after(self.core.ledger.relapse_wait_s):
                        await wake.wait()
                    if self.host.num_connections(peer) == 0:
                        break  # nobody to answer (the core leases nothing to a peer presumed dead)
                    if self.core.ledger.step == step:
                        reply = self._lease(peer, msg)
        finally:
            self._waiting -= 1
            if self._lease_waits.get(peer) is wake:
                del self._lease_waits[peer]
        return reply.model_copy(update={"waited_s": min(trio.current_time() - t0, cm.MAX_WAIT_S)})

    def _lease(self, peer: str, msg: cm.Lease) -> cm.LeaseReply:
        reply = self.core.handle(peer, msg, self.clock())
        assert isinstance(reply, cm.LeaseReply)  # the core answers a Lease with one
        self.commit()
        return reply

    async def _outer_wait(self, peer: str, msg: cm.OuterReady) -> cm.OuterDecision:
        """DiLoCo: record the arrival, then wait (up to ``msg.timeout_s``) for its outer round's decision. Each
        ask again is the same idempotent arrival (coordinator/core/outer_rounds.py)."""

        def ask() -> cm.OuterDecision:
            reply = self.core.handle(peer, msg, self.clock())
            assert isinstance(reply, cm.OuterDecision)  # the core answers an OuterReady with one
            self.commit()  # a decision wakes the other replicas' polls
            return reply

        reply = ask()
        if reply.role != "pending" or self._waiting >= self.core.settings.max_concurrent_waits:
            return reply  # decided, or no wait slot: the node asks again
        self._waiting += 1
        try:
            with trio.move_on_after(msg.timeout_s):
                while reply.role == "pending":
                    await self._changed.wait()
                    reply = ask()
            return reply
        finally:
            self._waiting -= 1

    async def _check_reachability(self, peer: str, msg: cm.ReachabilityRequest) -> cm.ReachabilityReply:
        """Dial ``peer`` back (see the module docstring): one check per peer, MAX_CHECKS at once, and at most
        MAX_CHECK_WAITERS more waiting (for at most SLOT_WAIT_S) for a slot; past those, "unknown" (busy)."""
        self.core.begin_reachability(peer, self.clock())
        verdict = None
        busy = False
        try:
            observed = self.host.observed_addr(peer)
            targets = dial_targets(observed, msg.addrs, peer)
            if self.checker is None or not targets:
                verdict = decide(targets, (), checker_up=self.checker is not None)
            elif self._checks_queued < MAX_CHECKS + MAX_CHECK_WAITERS:
                self._checks_queued += 1
                try:
                    with trio.move_on_after(SLOT_WAIT_S):
                        async with self._check_slots:
                            verdict = decide(targets, await self._dial_back(self.checker, peer, targets))
                finally:
                    self._checks_queued -= 1
            if verdict is None:  # no slot (in time): no verdict on the node, and none is recorded
                busy = True
                verdict = BUSY
            log.info("reachability peer=%s verdict=%s reason=%s", peer, verdict.verdict, verdict.reason)
            own = [*self.announce, *self.host.addrs()] if self.relay else []
            return self.core.reachability_reply(peer, verdict, observed, own)
        finally:
            self.core.end_reachability(peer, None if busy else verdict)

    async def _dial_back(self, checker: Host, peer: str, targets: list[str]) -> list[str]:
        """Dial every target in parallel from ``checker`` on a fresh connection; the ones that reached ``peer``.

        A dial counts only if the checker's connection to ``peer`` ends at that target's port: with one
        connection per peer, a parallel dial may return on another target's connection."""
        reached: list[str] = []
        await checker.disconnect(peer)  # never reuse a connection (e.g. one the node opened to the checker)

        async def dial(target: str) -> None:
            try:
                await checker.connect(target, timeout=DIAL_TIMEOUT_S)
            except ProtocolError as err:
                log.info("reachability dial failed peer=%s addr=%s reason=%s", peer, target, err.reason)
                return
            seen = checker.observed_addr(peer)
            if seen is not None and str(seen[1]) == target.split("/")[4]:
                reached.append(target)

        try:
            async with trio.open_nursery() as nursery:
                for t in targets:
                    nursery.start_soon(dial, t)
        finally:
            try:
                self._hang_up.send_nowait((peer, trio.current_time() + HANG_UP_DELAY_S))
            except trio.WouldBlock:  # a backlog of hang-ups: this one waits its turn here
                with trio.CancelScope(shield=True):
                    await checker.disconnect(peer)
        return reached

    async def checker_cleanup(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Close the checker's connection to each node it dialled back, HANG_UP_DELAY_S after the check
        (each close bounded by the checker's connect timeout, at most MAX_CHECKS at once)."""
        task_status.started()
        checker = self.checker
        if checker is None:
            return
        limit = trio.CapacityLimiter(MAX_CHECKS)

        async def hang_up(peer: str, token: object) -> None:
            try:
                await checker.disconnect(peer)
            finally:
                limit.release_on_behalf_of(token)

        async with trio.open_nursery() as nursery:
            async for peer, due in self._hang_ups:
                await trio.sleep_until(due)
                token = object()  # one per hang-up: the same peer may be queued twice
                await limit.acquire_on_behalf_of(token)
                nursery.start_soon(hang_up, peer, token)

    def flush_refusal_log(self, *, everything: bool = False) -> None:
        """Write the refusal summaries of the intervals that are over (all of them with ``everything``)."""
        _log_refusal_summaries(self._refusals.flush(self.host.clock(), everything=everything))

    async def housekeeping(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Every ``housekeeping_interval_s``, and as soon as a closed connection's grace ends: a dead stage-0 replica's
        leases end then, not up to an interval later (the held leases of the others take them at once)."""
        task_status.started()
        last_soft = last = trio.current_time()
        interval = self.core.settings.housekeeping_interval_s
        while True:
            gone_at = self.core.registry.next_gone_at()
            due = last + interval if gone_at is None else min(last + interval, trio.current_time() + gone_at - self.clock())
            with trio.move_on_at(due):
                await self._closed.wait()
            if self._closed.is_set():  # a connection closed: its grace may end before the next interval
                self._closed = trio.Event()
                continue
            last = trio.current_time()
            for event in self.core.housekeeping(self.clock()):
                log.info("%s", event)
            self.flush_refusal_log()
            soft = trio.current_time() - last_soft >= SOFT_PERSIST_S
            if soft:
                last_soft = trio.current_time()
            self.commit(soft=soft)


def _log_refusal_summaries(summaries: list[Summary[tuple[str, str, str]]]) -> None:
    for s in summaries:
        log.warning("refused %s request=%s code=%s reason=%s", s.head(), *s.last)


def _answered(msg: cm.WaitStep, info: cm.StepInfo) -> bool:
    """Whether the long poll has its answer: the step closed; or, ``until="committed"``, it committed
    at ``min_revision``, reopened (not closed any more) or closed again at a later revision."""
    if msg.until == "closed":
        return info.closed
    return info.committed or not info.closed or info.revision != msg.min_revision


def _load_evidence_checks() -> None:
    import protolearn.protocol.codecs  # noqa: F401 - imports torch


async def serve(
    run: Any,
    data_dir: Path | str,
    listen: Sequence[str] | str = ("/ip4/127.0.0.1/tcp/0",),
    *,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    settings: CoordinatorSettings | None = None,
    transport: TransportConfig | None = None,
    clock: Callable[[], float] = time.time,
    relay: bool = False,
    announce: Sequence[str] = (),
    link: LinkSpec | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the coordinator for ``run`` (a RunConfig) until cancelled; ``relay``: its host also relays for
    nodes behind NATs (and offers itself to them as their relay, at the ``announce`` addresses first);
    ``link``: an emulated link for its host."""
    settings = settings or CoordinatorSettings()
    listen = [listen] if isinstance(listen, str) else list(listen)
    data_dir = Path(data_dir)
    store, core, resumed = open_state(run, data_dir, settings, clock())
    identity = load_or_create_identity(data_dir)
    # A long poll holds a stream for up to MAX_WAIT_S, so requests need a longer deadline than that.
    transport = transport or TransportConfig(
        request_timeout_s=cm.MAX_WAIT_S + 5.0, link=link, max_connections=settings.max_connections,
        max_connections_per_ip=settings.max_connections_per_ip, max_pending_connections=PENDING_CONNECTIONS,
        identify_peers=False,
    )
    svc: _Service | None = None
    try:
        async with (
            open_host(identity, listen, transport, relay=RelayLimits() if relay else None) as host,
            # The reachability checker: its own throwaway identity, so its dials are fresh connections.
            open_host(Identity.generate(), [CHECKER_LISTEN], TransportConfig(connect_timeout_s=DIAL_TIMEOUT_S, bulk=False)) as checker,
        ):
            svc = _Service(
                core, store, host, clock, checker=checker, relay=relay, announce=[parse_announce(a, host.peer_id) for a in announce],
            )
            host.relay.admit = core.may_reserve
            host.on_connection = svc.connection_changed
            host.serve(
                cm.COORDINATOR,
                svc.on_request,
                request_type=REQUEST_TYPES,
                max_inbound=settings.max_concurrent_waits + 256,
                # Peers that are not live members (joiners, status readers, Sybils) share these slots, so
                # identities that never joined cannot crowd the members' heartbeats out.
                known=core.registry.is_live,
                max_inbound_unknown=UNKNOWN_STREAMS,
            )
            # One heartbeat stream per member (two while a reconnecting member's old one winds down).
            host.serve_stream(
                cm.BEATS, svc.on_beats, max_inbound=settings.max_connections, max_inbound_per_peer=2,
                known=core.registry.is_live, max_inbound_unknown=UNKNOWN_BEAT_STREAMS,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(svc.housekeeping)
                await nursery.start(svc.checker_cleanup)
                # Checking integrity evidence needs torch; loading it (seconds) in the first request's
                # handler would stall every heartbeat meanwhile, so it loads in a thread at start-up.
                nursery.start_soon(partial(trio.to_thread.run_sync, _load_evidence_checks, abandon_on_cancel=True))
                port = None
                if metrics_port is not None:
                    port = await nursery.start(serve_metrics, metrics_registry(core, clock), metrics_port, metrics_host)
                log.info(
                    "coordinator peer=%s run=%s step=%d members=%d resumed=%s",
                    host.peer_id, core.run.name, core.ledger.step, core.registry.num_live, resumed,
                )
                task_status.started(Running(host.peer_id, host.addrs(), port, core, host, Path(data_dir), checker=checker))
    finally:
        if svc is not None:
            svc.flush_refusal_log(everything=True)  # no count is lost at shutdown
        store.close()
