"""Inbound connections: how many a host takes in all, and from one IP address, before any handshake.

py-libp2p 0.8.1 has two caps of its own, and neither suits a host that many peers hold a connection to
(the coordinator: every member holds one):

- a swarm-wide limiter of ``max_connections - min_connections`` inbound slots (250 by default), and
  **each slot is held until the swarm stops, not until its connection closes** (measured: five
  connect/close cycles left five slots taken). After 250 inbound connections in its life a host
  refuses every new one. :func:`install` gives that limiter no limit and counts here instead;
- its resource manager (256 established inbound connections, 1,024 in all, 64 handshakes at once),
  which :func:`resource_manager` sizes from the config, as :func:`connection_config` does the swarm's
  ``max_connections`` (300 by default).

:class:`InboundCap` is the count (sans-IO): a connection from an IP address takes a slot from the moment
its TCP connection is accepted, before the Noise handshake spends any CPU, until it closes. One address
holds at most ``max_per_ip`` slots (loopback is exempt: it is this machine), so a raised global cap
cannot be taken by one address; handshakes in flight are at most ``max_pending`` from all addresses. A
connection over a cap is closed at once, before a byte is read, and counted in :attr:`InboundCap.refused`.
The global number of established connections is py-libp2p's own check (``max_connections``), which
counts live connections correctly.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections import Counter
from typing import Any

import trio
from libp2p.abc import IHost, INetConn
from libp2p.network.config import LOW_WATERMARK, MIN_CONNECTIONS, ConnectionConfig
from libp2p.network.swarm import SwarmException
from libp2p.rcmgr import ResourceManager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.rcmgr.manager import ResourceLimits, new_resource_manager

from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.connections import tcp_socket

log = logging.getLogger("protolearn.protocol")

# Handshakes in flight at once when the config does not say: py-libp2p's resource manager's default.
MAX_PENDING = 64
# Streams open at once over all connections (py-libp2p's default is 10,000): a few per connection.
STREAMS_PER_CONNECTION = 4


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


class InboundCap:
    """Inbound connections per IP address, pending (accepted, handshake running) and established."""

    def __init__(self, max_per_ip: int, max_pending: int, *, cap_loopback: bool = False) -> None:
        if max_per_ip < 1 or max_pending < 1:
            raise ValueError(f"max_per_ip ({max_per_ip}) and max_pending ({max_pending}) must be positive")
        self.max_per_ip = max_per_ip
        self.max_pending = max_pending
        # Loopback is this machine: exempt from the per-address cap unless asked (tests of the cap).
        self.cap_loopback = cap_loopback
        self._pending: Counter[str] = Counter()
        self._established: Counter[str] = Counter()
        self._num_pending = 0
        # The established connections counted, and the address each came from (released when it closes).
        self._conns: dict[int, str] = {}
        self.refused: Counter[str] = Counter()  # "handshakes" or "per_ip"

    def held(self, ip: str) -> int:
        return self._pending[ip] + self._established[ip]

    def begin(self, ip: str) -> str | None:
        """Take a pending slot for a connection accepted from ``ip``; why not (the slot is not taken), or None."""
        if self._num_pending >= self.max_pending:
            self.refused["handshakes"] += 1
            return f"{self._num_pending} handshakes in flight, the limit"
        if (self.cap_loopback or not is_loopback(ip)) and self.held(ip) >= self.max_per_ip:
            self.refused["per_ip"] += 1
            return f"{ip} holds {self.held(ip)} connections, the per-address limit"
        self._pending[ip] += 1
        self._num_pending += 1
        return None

    def end(self, ip: str) -> None:
        """The handshake of a connection from ``ip`` is over (whether it succeeded or not)."""
        self._pending[ip] -= 1
        if self._pending[ip] <= 0:
            del self._pending[ip]
        self._num_pending -= 1

    def opened(self, key: int, ip: str) -> None:
        """Connection ``key`` (an id the caller keeps) from ``ip`` is established."""
        if key not in self._conns:
            self._conns[key] = ip
            self._established[ip] += 1

    def closed(self, key: int) -> None:
        ip = self._conns.pop(key, None)
        if ip is not None:
            self._established[ip] -= 1
            if self._established[ip] <= 0:
                del self._established[ip]

    @property
    def num_established(self) -> int:
        return len(self._conns)


def connection_config(config: TransportConfig) -> ConnectionConfig:
    """py-libp2p's connection settings: one connection per peer (every dial otherwise waits 250 ms for a
    second one), and at most ``config.max_connections``, with the pruning watermark at that cap."""
    cap = config.max_connections
    return ConnectionConfig(
        max_connections_per_peer=1, max_connections=cap, high_watermark=cap,
        low_watermark=min(LOW_WATERMARK, cap), min_connections=min(MIN_CONNECTIONS, cap),
    )


def resource_manager(config: TransportConfig) -> ResourceManager:
    """py-libp2p's resource manager with its connection limits at ``config.max_connections``."""
    cap = config.max_connections
    limits = ConnectionLimits(
        max_pending_inbound=config.max_pending_connections, max_pending_outbound=None,
        max_established_inbound=cap, max_established_outbound=cap, max_established_per_peer=8, max_established_total=cap,
    )
    return new_resource_manager(
        limits=ResourceLimits(max_connections=cap, max_streams=max(10_000, STREAMS_PER_CONNECTION * cap)),
        connection_limits=limits,
    )


def _remote_ip(raw_conn: Any) -> str | None:
    try:
        addr = raw_conn.get_remote_address()
    except (OSError, AttributeError):
        return None
    return None if addr is None else str(addr[0])


def _conn_ip(conn: INetConn) -> str | None:
    sock = tcp_socket(conn)
    if sock is None:
        return None
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return None


def install(lp: IHost, cap: InboundCap) -> None:
    """Count ``lp``'s inbound connections in ``cap``: refuse one over a cap before its handshake, and lift
    py-libp2p's own inbound limiter, whose slots never come back (module docstring). The caller tells
    :meth:`InboundCap.opened`/:meth:`InboundCap.closed` from the network's notifee (:func:`count_opened`, :func:`count_closed`)."""
    swarm: Any = lp.get_network()
    swarm._inbound_limiter = trio.CapacityLimiter(math.inf)
    upgrade = swarm.upgrade_inbound_raw_conn

    async def capped(raw_conn: Any, maddr: Any) -> Any:
        ip = _remote_ip(raw_conn)
        if ip is None:
            return await upgrade(raw_conn, maddr)
        why = cap.begin(ip)
        if why is not None:
            log.debug("inbound connection refused ip=%s reason=%s", ip, why)
            await raw_conn.close()
            raise SwarmException(f"inbound connection refused: {why}")
        try:
            return await upgrade(raw_conn, maddr)
        finally:
            cap.end(ip)

    swarm.upgrade_inbound_raw_conn = capped


def count_opened(cap: InboundCap, conn: INetConn) -> None:
    """An established connection: count it under its address if it is inbound."""
    muxed = getattr(conn, "muxed_conn", None)
    initiator = getattr(muxed, "is_initiator", None)
    # Yamux's is a method, other muxers' an attribute.
    if muxed is None or (initiator() if callable(initiator) else initiator) is not False:
        return
    ip = _conn_ip(conn)
    if ip is not None:
        cap.opened(id(conn), ip)


def count_closed(cap: InboundCap, conn: INetConn) -> None:
    cap.closed(id(conn))


__all__ = ["InboundCap", "connection_config", "count_closed", "count_opened", "install", "resource_manager"]
