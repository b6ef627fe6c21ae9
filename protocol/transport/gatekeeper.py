"""The gate's side in the swarm: bans carried out on connections, and the gate's logs written on time.

The sans-IO :class:`~protolearn.protocol.gate.Gate` decides who is refused; :class:`Gatekeeper` does what
that takes in py-libp2p. A ban (for good, :meth:`~Gatekeeper.ban`, or for a while, the gate's ``on_ban``)
closes the peer's connections; bans are decided synchronously and closing is async, so a bounded queue
hands the peer to :meth:`~Gatekeeper.disconnect_service`. :class:`ConnectionWatch`, registered with the
swarm, closes a banned peer's connection as soon as it is established and tells the host about every
other peer that connects or loses its last connection (and counts inbound connections per address,
:mod:`.inbound`). :meth:`~Gatekeeper.log_service` writes each
peer's rejection and refusal summaries when their interval ends (the first of each in full, then
counts: a peer must not fill the disk with our logs).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.exceptions import BaseLibp2pError

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.gate import BULK_LIMIT, Abuse, Gate
from protolearn.protocol.log_digest import LogDigest, Summary
from protolearn.protocol.transport.clock import Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.inbound import InboundCap, count_closed, count_opened
from protolearn.protocol.transport.libp2p_errors import why
from protolearn.protocol.transport.names import parse_peer_id

log = logging.getLogger("protolearn.protocol")

# Peers waiting for their connections to be closed; past it a banned peer's idle connection lingers.
DISCONNECT_QUEUE = 1024


class Gatekeeper:
    """The gate of host ``lp`` (``gate``: its verdicts and counts) and what carries them out."""

    def __init__(self, lp: IHost, config: TransportConfig, clock: Clock) -> None:
        self._lp = lp
        self.config = config
        self.clock = clock
        abuse = Abuse(window_s=config.abuse_window_s, threshold=config.abuse_threshold, ban_s=config.temp_ban_s, max_peers=config.abuse_max_peers)
        self.gate = Gate(
            log_interval_s=config.rejection_log_interval_s, log_max_peers=config.rejection_log_max_peers,
            abuse=abuse, on_ban=self.schedule_disconnect,
        )
        # (protocol, reason) of requests a handler refused on purpose: logged per peer and interval too,
        # since a peer can ask for refusals as fast as for rejections.
        self._refusal_log: LogDigest[tuple[str, str]] = LogDigest(
            interval_s=config.rejection_log_interval_s, max_peers=config.rejection_log_max_peers,
        )
        self._disconnect_send, self._disconnect_recv = trio.open_memory_channel[str](DISCONNECT_QUEUE)

    # -- bans -----------------------------------------------------------------------------------

    def ban(self, peer_id: str, reason: str) -> None:
        """Refuse ``peer_id`` from now on and close its connections."""
        self.gate.ban(peer_id, reason)
        self.schedule_disconnect(peer_id)

    def ban_reason(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is refused now: banned for good, or for a while (protocol/gate.py); None if not."""
        return self.gate.ban_reason(peer_id, self.clock())

    def bulk_over_limit(self, peer_id: str, reason: str) -> None:
        """The bulk lane declined ``peer_id`` for its own limits: a rejection like any other."""
        self.gate.reject(peer_id, "bulk", BULK_LIMIT, reason, self.clock())

    def schedule_disconnect(self, peer_id: str) -> None:
        try:
            self._disconnect_send.send_nowait(peer_id)
        except trio.WouldBlock:
            # The stream gate still refuses the peer; its idle connection just lingers a while.
            log.warning("disconnect queue full; banned peer=%s stays connected until it idles", peer_id)

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id`` (bounded by ``connect_timeout_s``; errors are logged)."""
        with trio.move_on_after(self.config.connect_timeout_s):
            try:
                await self._lp.disconnect(parse_peer_id(peer_id))
            except (BaseLibp2pError, OSError, ProtocolError) as err:
                log.info("could not close connection peer=%s reason=%s", peer_id, why(err))

    async def disconnect_service(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for peer_id in self._disconnect_recv:
            await self.disconnect(peer_id)

    # -- logs -----------------------------------------------------------------------------------

    def log_refusal(self, peer: str, name: str, kind: str, reason: str) -> None:
        """Log that this host refused ``peer`` on protocol ``name``: the first time per peer and interval
        in full, then only counted into one summary line (a peer must not fill the disk with our logs)."""
        write, due = self._refusal_log.note(peer, kind, (name, reason), self.clock())
        _log_refusal_summaries(due)
        if write:
            log.info("refused peer=%s protocol=%s reason=%s", peer, name, reason)

    def flush_logs(self, *, everything: bool = False) -> None:
        self.gate.flush_log(self.clock(), everything=everything)
        _log_refusal_summaries(self._refusal_log.flush(self.clock(), everything=everything))

    async def log_service(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write each peer's rejection and refusal summaries when their interval ends, also when the
        peer went quiet."""
        task_status.started()
        interval = self.config.rejection_log_interval_s
        while True:
            now = self.clock()
            due = min((d for d in (self.gate.next_log_due(), self._refusal_log.next_due()) if d is not None), default=None)
            # An interval that starts after this sleep began ends after it does: nothing is late.
            await trio.sleep(interval if due is None else max(due - now, interval / 100))
            self.flush_logs()


class ConnectionWatch(INotifee):
    """Closes a banned peer's connection as soon as the swarm reports it, and tells ``on_change(peer,
    connected)`` when any other peer connects or its last connection closes (e.g. it died).

    A closed connection is told as soon as it is marked closed, not when py-libp2p notifies it: its
    ``SwarmConn.close`` first closes the muxer and resets the streams, then sleeps 0.1 s, and only then
    notifies, about 0.2 s after a crashed peer's EOF, which the coordinator's commit barrier and stage 0's
    restart of tickets in flight waited out (issue 28). With ``nursery`` set (the host's services), one task
    per connection waits for its ``event_closed``; the later notification of a connection already told
    is not told again."""

    def __init__(self, keeper: Gatekeeper, on_change: Callable[[str, bool], None], inbound: InboundCap | None = None) -> None:
        self._keeper = keeper
        self._on_change = on_change
        # Counts each inbound connection under its address while it lives (inbound.py).
        self._inbound = inbound
        self.nursery: trio.Nursery | None = None
        # Connections whose close was told early (weakly: a connection py-libp2p never notifies is not kept).
        self._told: weakref.WeakSet[INetConn] = weakref.WeakSet()

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        if self._inbound is not None:
            count_opened(self._inbound, conn)
        peer = str(conn.muxed_conn.peer_id)
        keeper = self._keeper
        rejection = keeper.gate.check_connection(peer, keeper.clock())
        if rejection is not None:
            keeper.gate.record(rejection, keeper.clock())
            keeper.schedule_disconnect(peer)
            return
        self._on_change(peer, True)
        closed = getattr(conn, "event_closed", None)
        if self.nursery is not None and closed is not None:
            self.nursery.start_soon(self._watch, network, conn, closed)

    async def _watch(self, network: INetwork, conn: INetConn, closed: trio.Event) -> None:
        await closed.wait()
        if self._inbound is not None:
            count_closed(self._inbound, conn)  # its address's slot is free once it is closed (idempotent)
        peer = conn.muxed_conn.peer_id
        if not any(not c.is_closed for c in network.get_connections(peer)):
            self._told.add(conn)
            self._on_change(str(peer), False)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        if self._inbound is not None:
            count_closed(self._inbound, conn)
        if conn in self._told:
            self._told.discard(conn)
            return
        peer = conn.muxed_conn.peer_id
        # Only the peer's last connection going away means it is gone.
        self._on_change(str(peer), any(not c.is_closed for c in network.get_connections(peer)))

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


def _log_refusal_summaries(summaries: list[Summary[tuple[str, str]]]) -> None:
    for s in summaries:
        log.info("refused %s protocol=%s reason=%s", s.head(), *s.last)


__all__ = ["ConnectionWatch", "Gatekeeper"]
