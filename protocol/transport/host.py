"""The libp2p host: TCP + Noise only + yamux, the ban gate, request/response and stream opening.

See the package docstring of :mod:`protolearn.protocol.transport` for the API. :func:`open_host` runs
the swarm in a shielded task of its own, so that a cancelled ``async with open_host(...)`` block can
still use the host in its cleanup (a node's leave on SIGTERM); "Lifetime" there says why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import multiaddr
import trio
from libp2p import create_yamux_muxer_option, new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from protolearn.errors import ConfigError, ProtolearnError
from protolearn.protocol.addresses import DEFAULT_LISTEN, advertised, check_port_free, parse_multiaddr, strip_p2p
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError, Refused, WrongPeer
from protolearn.protocol.gate import (
    DEFAULT_ABUSE_THRESHOLD,
    DEFAULT_ABUSE_WINDOW_S,
    DEFAULT_MAX_TRACKED,
    DEFAULT_TEMP_BAN_S,
    BULK_LIMIT,
    Abuse,
    Gate,
)
from protolearn.protocol.log_digest import LogDigest, Summary
from protolearn.protocol.transport.bulk import BulkLane, lane_ip
from protolearn.protocol.transport.clock import MONOTONIC, Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.holepunch import HolePuncher
from protolearn.protocol.transport.relay import Relay, RelayLimits, is_circuit, split_circuit
from protolearn.protocol.transport.streams import FramedStream
from protolearn.protocol.wire import ErrorReply, Message

PROTOCOL_PREFIX = "/protolearn/"
# The version in every protocol ID (/protolearn/<name>/1.0.0), not the message envelope's (wire.WIRE_VERSION).
PROTOCOL_ID_VERSION = "1.0.0"
# Peers whose dial addresses a host keeps (see Host._remember).
MAX_KNOWN_PEERS = 16384
# How long a peer's address stays in the peerstore after connect/add_peer_addrs (seconds).
ADDR_TTL_S = 3600

log = logging.getLogger("protolearn.protocol")

R = TypeVar("R", bound=Message)
RequestHandler = Callable[[str, Message], Awaitable[Message]]
StreamHandler = Callable[[str, FramedStream], Awaitable[None]]


def protocol_id(name: str) -> str:
    """The versioned libp2p protocol ID of a protolearn protocol name."""
    return f"{PROTOCOL_PREFIX}{name}/{PROTOCOL_ID_VERSION}"


class HasSeed(Protocol):
    @property
    def private_bytes(self) -> bytes: ...


class _BanNotifee(INotifee):
    """Closes a banned peer's connection as soon as the swarm reports it."""

    def __init__(self, host: Host) -> None:
        self._host = host

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer = str(conn.muxed_conn.peer_id)
        rejection = self._host.gate.check_connection(peer, self._host.clock())
        if rejection is not None:
            self._host.gate.record(rejection, self._host.clock())
            self._host._schedule_disconnect(peer)
        elif self._host.on_connection is not None:
            self._host.on_connection(peer, True)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        # Only the peer's last connection going away means it is gone.
        still = any(not c.is_closed for c in network.get_connections(peer))
        if not still:
            self._host.relay.peer_gone(str(peer))
        if self._host.on_connection is not None:
            self._host.on_connection(str(peer), still)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class Host:
    """A running libp2p host. Build it with :func:`open_host`; see the module docstring for the API."""

    def __init__(self, lp: IHost, config: TransportConfig, *, clock: Clock = MONOTONIC, relay: RelayLimits | None = None) -> None:
        self._lp = lp
        self.config = config
        # The transport's one clock (protocol/transport/clock.py): the rejection log's intervals and
        # the bulk lane's offers, marks and chunk deadlines are measured in it; a test may pass a fake.
        self.clock = clock
        self.peer_id = str(lp.get_id())
        abuse = Abuse(window_s=config.abuse_window_s, threshold=config.abuse_threshold, ban_s=config.temp_ban_s, max_peers=config.abuse_max_peers)
        self.gate = Gate(
            log_interval_s=config.rejection_log_interval_s, log_max_peers=config.rejection_log_max_peers,
            abuse=abuse, on_ban=self._schedule_disconnect,
        )
        # (protocol, reason) of requests a handler refused on purpose: logged per peer and interval too,
        # since a peer can ask for refusals as fast as for rejections.
        self._refusal_log: LogDigest[tuple[str, str]] = LogDigest(
            interval_s=config.rejection_log_interval_s, max_peers=config.rejection_log_max_peers,
        )
        self.requests_served = 0  # requests answered with a normal (non-error) reply
        # None when config.bulk is off; host.bulk.stats counts what went over the lane.
        self.bulk: BulkLane | None = None
        if config.bulk:
            self.bulk = BulkLane(
                min_bytes=config.bulk_min_bytes, connect_timeout_s=config.bulk_connect_timeout_s,
                max_pending=config.max_inbound_streams, max_pending_bytes=config.bulk_max_pending_bytes,
                offer_ttl_s=config.chunk_timeout_s + config.bulk_connect_timeout_s, clock=clock,
                max_pending_per_peer=config.bulk_max_pending_per_peer,
                max_pending_bytes_per_peer=config.bulk_max_pending_bytes_per_peer,
                max_hellos_per_ip=config.bulk_max_hellos_per_ip,
                message_deadline_s=config.message_deadline_s, min_rate=config.min_rate_bytes_per_s,
                on_over_limit=lambda peer, reason: self.gate.reject(peer, "bulk", BULK_LIMIT, reason, self.clock()),
            )
        # Where we were told a peer listens (a full address dialled, or add_peer_addrs). A peer's
        # identify replaces our peerstore entry with what it advertises, which for a 0.0.0.0 listener
        # is /ip4/0.0.0.0/..., useless from another machine; a redial goes back to these.
        self._dial_addrs: dict[str, list[multiaddr.Multiaddr]] = {}
        # Relayed addresses (<relay>/p2p/<relay id>/p2p-circuit/p2p/<id>) we were given for a peer: the
        # swarm cannot dial them, so a peer with only these is dialled through its relay (relay.py).
        self._circuit_addrs: dict[str, list[str]] = {}
        # The relay protocol: always its client side, the relaying side when ``relay`` limits are given.
        self.relay = Relay(self, relay)
        # DCUtR (holepunch.py); set by open_host. ``punch``: try to punch after opening a circuit (a
        # node whose NAT rewrites ports turns it off); ``public_ip``: the address a punch offers.
        self.puncher: HolePuncher | None = None
        self.punch = True
        self._nursery: trio.Nursery | None = None
        # Bans are decided synchronously; closing the connection is async, so a service task does it.
        self._disconnect_send, self._disconnect_recv = trio.open_memory_channel[str](1024)
        # Told (peer, connected) when a peer connects or its last connection closes (e.g. it died);
        # it runs inside libp2p's notifier, so it must be quick and must not raise.
        self.on_connection: Callable[[str, bool], None] | None = None

    # -- addresses and dialling ---------------------------------------------------------------

    def addrs(self) -> list[str]:
        """Full multiaddrs with ``/p2p/<id>``, 127.0.0.1 first (see :func:`addresses.advertised`)."""
        return advertised([str(a) for a in self._lp.get_addrs()], self.peer_id)

    @property
    def libp2p(self) -> IHost:
        """The py-libp2p host underneath (for the relay protocol, which speaks libp2p's own messages)."""
        return self._lp

    @property
    def relaying(self) -> bool:
        """Whether this host relays for others (``open_host(..., relay=RelayLimits())``)."""
        return self.relay.relaying

    @property
    def public_ip(self) -> str | None:
        """The IP this host is seen at from outside (told by the coordinator); offered in hole punches."""
        return None if self.puncher is None else self.puncher.public_ip

    @public_ip.setter
    def public_ip(self, ip: str | None) -> None:
        if self.puncher is not None:
            self.puncher.public_ip = ip

    async def reserve(self, relay_addr: str, *, timeout: float) -> str:
        """Reserve a slot on the relay at ``relay_addr``; this host's circuit address through it, which
        peers can dial. Renewed in the background while the host runs. PeerUnavailable or Refused if not."""
        return await self.relay.reserve(relay_addr, timeout=timeout)

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember where ``peer_id`` listens, so requests can dial it by ID (relayed addresses too)."""
        pid = _parse_peer_id(peer_id)
        circuits = [a for a in addrs if is_circuit(a)]
        for a in circuits:
            split_circuit(a, peer_id)  # a malformed one raises here, naming the peer
        maddrs = [strip_p2p(parse_multiaddr(a, peer_id)) for a in addrs if not is_circuit(a)]
        self._remember(str(pid), maddrs, circuits)
        if maddrs:
            self._lp.get_peerstore().add_addrs(pid, maddrs, ADDR_TTL_S)

    async def connect(self, addr: str, *, timeout: float | None = None) -> str:
        """Dial ``addr`` (which must end in ``/p2p/<id>``) and return the peer ID.

        Noise authenticates the remote; a remote whose key does not match the ``/p2p/`` part raises
        :class:`WrongPeer` (nobody listening, or a failed dial, raises :class:`PeerUnavailable`).
        """
        if is_circuit(addr):
            return await self._connect_circuit(addr, timeout)
        maddr = parse_multiaddr(addr, "unknown")
        try:
            info = info_from_p2p_addr(maddr)
        except (BaseLibp2pError, ValueError) as err:
            raise PeerUnavailable("unknown", f"address {addr!r} has no /p2p/<peer id> part ({err}); copy the full address the peer prints") from None
        peer = str(info.peer_id)
        if (why := self.ban_reason(peer)) is not None:
            raise Refused(peer, f"not connecting: peer is banned ({why})")
        limit = self.config.connect_timeout_s if timeout is None else timeout
        self._remember(peer, [strip_p2p(maddr)], self._circuit_addrs.get(peer, []))
        try:
            with trio.fail_after(limit):
                await self._prepare_dial(info.peer_id)
                await self._lp.connect(info)
        except trio.TooSlowError:
            raise PeerUnavailable(peer, f"could not connect to {addr} within {limit:g} s") from None
        except (BaseLibp2pError, OSError) as err:
            if any(isinstance(e, PeerIDMismatchesPubkey) for e in _causes(err)):
                raise WrongPeer(peer, f"{strip_p2p(maddr)} answered with another peer id than {peer}") from None
            raise PeerUnavailable(peer, f"could not connect to {addr}: {_why(err)}") from None
        return peer

    def _remember(self, peer: str, direct: list[multiaddr.Multiaddr], circuits: list[str]) -> None:
        """Keep where ``peer`` can be dialled, for at most MAX_KNOWN_PEERS peers (the least recently told
        forgotten first): a coordinator's reachability checker dials every joiner once."""
        for table, value in ((self._dial_addrs, direct), (self._circuit_addrs, circuits)):
            table.pop(peer, None)  # re-insert at the end: dicts keep insertion order
            table[peer] = value  # type: ignore[index]
            while len(table) > MAX_KNOWN_PEERS:
                del table[next(iter(table))]

    async def _connect_circuit(self, addr: str, timeout: float | None) -> str:
        """Dial the peer behind relayed address ``addr`` through its relay, then (once, in the
        background, if ``punch``) try to replace that connection by a hole-punched direct one."""
        _, peer = split_circuit(addr, "unknown")
        if (why := self.ban_reason(peer)) is not None:
            raise Refused(peer, f"not connecting: peer is banned ({why})")
        known = self._circuit_addrs.get(peer, [])
        if addr not in known:
            self._remember(peer, self._dial_addrs.get(peer, []), [addr, *known])
        if self.path_to(peer) is not None:
            return peer
        await self.relay.dial(addr, timeout=self.config.connect_timeout_s if timeout is None else timeout)
        if self.punch and self.puncher is not None and self._nursery is not None:
            self._nursery.start_soon(self.puncher.punch, peer)
        return peer

    async def _dial_relayed(self, pid: ID) -> bool:
        """If ``pid`` is known only by relayed addresses and not connected, dial it through a relay.

        The swarm cannot dial those addresses, and it would otherwise dial the private addresses the
        peer's identify put in the peerstore (unreachable behind its NAT, a stall until the deadline)."""
        peer = str(pid)
        circuits = self._circuit_addrs.get(peer)
        if not circuits or self._dial_addrs.get(peer) or self.path_to(peer) is not None:
            return False
        self._lp.get_peerstore().clear_addrs(pid)
        why = "no relayed address"
        for addr in list(circuits):
            try:
                await self._connect_circuit(addr, None)
                return True
            except ProtocolError as err:
                why = err.reason
        raise PeerUnavailable(peer, f"could not reach it through any relay: {why}")

    async def _prepare_dial(self, pid: ID) -> None:
        """Undo what py-libp2p remembers about a peer that would stop a redial after it restarted.

        Three things: a failed dial (py-libp2p refuses to dial that peer again for 60 s, though
        callers here have their own deadlines and retries); a connection the remote closed, which
        py-libp2p keeps in its table and reuses ("No valid connections") instead of dialling; and
        the peer's advertised addresses, which replaced the ones we were told (see ``_dial_addrs``).
        """
        net = self._lp.get_network()
        cache = getattr(net, "_negative_peer_cache", None)
        if cache is not None:
            cache.evict(str(pid))
        conns = net.get_connections(pid)
        if conns and all(c.is_closed for c in conns):
            await net.close_peer(pid)
            conns = []
        known = self._dial_addrs.get(str(pid))
        if not conns and await self._dial_relayed(pid):
            return
        if not conns and known:
            store = self._lp.get_peerstore()
            store.clear_addrs(pid)
            store.add_addrs(pid, known, ADDR_TTL_S)

    async def _ensure_peer(self, peer: str) -> ID:
        if peer.startswith("/"):
            peer = await self.connect(peer)
        pid = _parse_peer_id(peer)
        if (why := self.ban_reason(peer)) is not None:
            raise Refused(peer, f"peer is banned ({why})")
        return pid

    # -- connections --------------------------------------------------------------------------

    def _live_conns(self, peer_id: str) -> list[INetConn]:
        try:
            pid = ID.from_base58(peer_id)
        except Exception:  # base58 and multihash raise several unrelated types
            return []
        return [c for c in self._lp.get_network().get_connections(pid) if not c.is_closed]

    def path_to(self, peer_id: str) -> str | None:
        """How this host reaches ``peer_id`` now: "direct", "hole-punched" (a direct connection a DCUtR
        punch made), "relayed" (only through a relay), or None when not connected."""
        conns = self._live_conns(peer_id)
        if not conns:
            return None
        if all(_is_relayed(c) for c in conns):
            return "relayed"
        if self.puncher is not None and peer_id in self.puncher.punched:
            return "hole-punched"
        return "direct"

    async def open_raw_stream(self, peer: str, proto: str) -> INetStream:
        """A raw libp2p stream of ``proto`` to a connected ``peer`` (the relay protocols' own framing)."""
        try:
            return await self._lp.new_stream(_parse_peer_id(peer), [proto])  # type: ignore[list-item]
        except (BaseLibp2pError, OSError) as err:
            raise PeerUnavailable(peer, f"could not open {proto}: {_why(err)}") from None

    async def close_raw(self, raw: INetStream, *, reset: bool = False) -> None:
        if reset:
            await reset_quietly(raw, self.config.chunk_timeout_s)
            return
        with trio.move_on_after(self.config.chunk_timeout_s):
            try:
                await raw.close()
            except (BaseLibp2pError, OSError):
                pass

    def observed_addr(self, peer_id: str) -> tuple[str, int] | None:
        """The (ip, port) that ``peer_id``'s live connection comes from, as this host sees it (behind a
        NAT: the router's address and the port it mapped); None if not connected over TCP."""
        for conn in self._live_conns(peer_id):
            sock = _tcp_socket(conn)
            if sock is not None:
                try:
                    ip, port = sock.getpeername()[:2]
                except OSError:
                    continue
                return str(ip), int(port)
        return None

    def local_port(self, peer_id: str) -> int | None:
        """This host's own TCP port on its live connection to ``peer_id`` (None if not connected over TCP).

        Compared with the port the peer saw (:meth:`observed_addr` on its side), it tells whether a NAT
        between them keeps source ports, which TCP hole punching needs."""
        for conn in self._live_conns(peer_id):
            sock = _tcp_socket(conn)
            if sock is not None:
                try:
                    return int(sock.getsockname()[1])
                except OSError:
                    continue
        return None

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id`` (bounded by ``connect_timeout_s``; errors are logged)."""
        with trio.move_on_after(self.config.connect_timeout_s):
            try:
                await self._lp.disconnect(_parse_peer_id(peer_id))
            except (BaseLibp2pError, OSError, ProtocolError) as err:
                log.info("could not close connection peer=%s reason=%s", peer_id, _why(err))

    # -- the gate -----------------------------------------------------------------------------

    def ban(self, peer_id: str, reason: str) -> None:
        """Refuse ``peer_id`` from now on and close its connections."""
        self.gate.ban(peer_id, reason)
        self._schedule_disconnect(peer_id)

    def unban(self, peer_id: str) -> None:
        self.gate.unban(peer_id)

    def sign(self, data: bytes) -> bytes:
        """Sign ``data`` with this host's identity key (Ed25519, RFC 8032): what peers verify against its peer ID."""
        return self._lp.get_private_key().sign(data)

    def is_banned(self, peer_id: str) -> bool:
        """Banned for good (:meth:`ban`). A temporary ban for repeated abuse is :meth:`ban_reason`'s."""
        return self.gate.is_banned(peer_id)

    def ban_reason(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is refused now: banned for good, or for a while (protocol/gate.py); None if not."""
        return self.gate.ban_reason(peer_id, self.clock())

    def active_streams(self, name: str, peer: str | None = None) -> int:
        """How many inbound streams of protocol ``name`` (from ``peer``, if given) are being handled right now."""
        return self.gate.active_streams(name, peer)

    def _schedule_disconnect(self, peer_id: str) -> None:
        try:
            self._disconnect_send.send_nowait(peer_id)
        except trio.WouldBlock:
            # The stream gate still refuses the peer; its idle connection just lingers a while.
            log.warning("disconnect queue full; banned peer=%s stays connected until it idles", peer_id)

    async def _disconnect_service(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for peer_id in self._disconnect_recv:
            await self.disconnect(peer_id)

    def log_refusal(self, peer: str, name: str, kind: str, reason: str) -> None:
        """Log that this host refused ``peer`` on protocol ``name``: the first time per peer and interval
        in full, then only counted into one summary line (a peer must not fill the disk with our logs)."""
        write, due = self._refusal_log.note(peer, kind, (name, reason), self.clock())
        _log_refusal_summaries(due)
        if write:
            log.info("refused peer=%s protocol=%s reason=%s", peer, name, reason)

    def _flush_logs(self, *, everything: bool = False) -> None:
        self.gate.flush_log(self.clock(), everything=everything)
        _log_refusal_summaries(self._refusal_log.flush(self.clock(), everything=everything))

    async def _rejection_log_service(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write each peer's rejection and refusal summaries when their interval ends, also when the
        peer went quiet."""
        task_status.started()
        interval = self.config.rejection_log_interval_s
        while True:
            now = self.clock()
            due = min((d for d in (self.gate.next_log_due(), self._refusal_log.next_due()) if d is not None), default=None)
            # An interval that starts after this sleep began ends after it does: nothing is late.
            await trio.sleep(interval if due is None else max(due - now, interval / 100))
            self._flush_logs()

    # -- serving ------------------------------------------------------------------------------

    def serve(
        self,
        name: str,
        handler: RequestHandler,
        *,
        request_type: type[Message] | tuple[type[Message], ...],
        max_inbound: int | None = None,
        max_bytes: int | None = None,
        max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None,
        max_inbound_unknown: int | None = None,
    ) -> None:
        """Answer ``/protolearn/<name>/1.0.0``: one request and one reply per inbound stream.

        A request may be at most ``max_bytes`` (default ``config.max_message_bytes``); at most
        ``max_inbound`` requests are read at once (at most ``max_inbound_per_peer``, default
        ``config.max_inbound_streams_per_peer``, from one peer), so this protocol buffers at most their product.
        ``known``/``max_inbound_unknown``: as for :meth:`serve_stream`.
        """
        request_limit = self.config.max_message_bytes if max_bytes is None else max_bytes

        async def on_stream(peer: str, s: FramedStream) -> None:
            s.max_message_bytes = request_limit
            try:
                # An honest caller writes its request at once: an idle stream is let go after the base deadline.
                request = await s.receive(request_type, timeout=min(self.config.request_timeout_s, self.config.message_deadline_s))
            except ProtocolError as err:
                self.gate.reject(peer, name, type(err).__name__, err.reason, self.clock())
                await self._refuse(s, err)
                return
            try:
                reply = await handler(peer, request)
            except ProtocolError as err:
                self.gate.reject(peer, name, type(err).__name__, err.reason, self.clock())
                reply = ErrorReply(code=type(err).__name__, reason=err.reason)
            except ProtolearnError as err:
                self.log_refusal(peer, name, type(err).__name__, str(err))
                reply = ErrorReply(code=type(err).__name__, reason=str(err))
            await s.send(reply, timeout=self.config.request_timeout_s)
            if not isinstance(reply, ErrorReply):
                self.requests_served += 1

        self._register(name, on_stream, max_inbound, max_inbound_per_peer, known, max_inbound_unknown)

    async def _refuse(self, s: FramedStream, err: ProtocolError) -> None:
        # Tell an honest but mismatched peer why (e.g. an old version), then drop the stream. The
        # grace is short and the drain bounded, so a hostile peer gains nothing by not reading.
        with trio.move_on_after(min(1.0, self.config.chunk_timeout_s)):
            try:
                await s.send(ErrorReply(code=type(err).__name__, reason=err.reason))
                await s.close()
                await s.drain(s.max_message_bytes)
            except ProtocolError:
                pass  # the peer is gone or not reading; the rejection is already logged
        await s.reset()

    def serve_stream(
        self, name: str, handler: StreamHandler, *, max_inbound: int | None = None, max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        """Hand each inbound stream of ``/protolearn/<name>/1.0.0`` to ``handler(peer_id, stream)``.

        With ``known`` (e.g. "a member of my stage"), peers it says no to share at most
        ``max_inbound_unknown`` of the ``max_inbound`` streams, so Sybils cannot crowd known peers out.

        A handler's :class:`ProtocolError` is logged as a rejection, others are logged; either way the
        stream is reset. A normal return half-closes the stream.
        """
        self._register(name, handler, max_inbound, max_inbound_per_peer, known, max_inbound_unknown)

    def _register(
        self, name: str, handler: StreamHandler, max_inbound: int | None, max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        async def framed(peer: str, raw: INetStream) -> None:
            await self._run_handler(handler, peer, name, self._wrap(raw, peer, name))

        self.serve_raw(protocol_id(name), name, framed, max_inbound=max_inbound, max_inbound_per_peer=max_inbound_per_peer,
                       known=known, max_inbound_unknown=max_inbound_unknown)

    def serve_raw(
        self, pid: str, name: str, handler: Callable[[str, INetStream], Awaitable[None]], *, max_inbound: int | None = None,
        max_inbound_per_peer: int | None = None, known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        """Hand each inbound stream of libp2p protocol ``pid`` to ``handler(peer_id, raw stream)`` once the
        gate admits it (counted under ``name``). For protocols whose messages are not protolearn's (the
        relay's HOP and STOP): banned peers and peers over their stream limits are refused the same way.
        The handler owns the stream and catches its own errors."""
        limit = self.config.max_inbound_streams if max_inbound is None else max_inbound
        peer_limit = min(limit, self.config.max_inbound_streams_per_peer if max_inbound_per_peer is None else max_inbound_per_peer)
        if limit <= 0 or peer_limit <= 0:
            raise ValueError(f"max_inbound ({limit}) and max_inbound_per_peer ({peer_limit}) must be positive")

        async def on_raw_stream(raw: INetStream) -> None:
            peer = str(raw.muxed_conn.peer_id)
            outsider = known is not None and not known(peer)
            rejection = self.gate.admit_stream(
                peer, name, limit=limit, peer_limit=peer_limit, now=self.clock(), outsider=outsider, outsider_limit=max_inbound_unknown,
            )
            if rejection is not None:
                await reset_quietly(raw, self.config.chunk_timeout_s)
                if self.ban_reason(peer) is not None:
                    self._schedule_disconnect(peer)
                return
            try:
                await handler(peer, raw)
            finally:
                self.gate.release_stream(peer, name)

        self._lp.set_stream_handler(pid, on_raw_stream)  # type: ignore[arg-type]

    async def _run_handler(self, handler: StreamHandler, peer: str, name: str, s: FramedStream) -> None:
        # The one broad catch: a handler failure must never take the host down.
        try:
            await handler(peer, s)
        except ProtocolError as err:
            self.gate.reject(peer, name, type(err).__name__, err.reason, self.clock())
            await s.reset()
            return
        except Exception as err:
            self.gate.reject(peer, name, "handler_error", f"handler failed: {type(err).__name__}: {err}", self.clock())
            log.exception("handler failed peer=%s protocol=%s", peer, name)
            await s.reset()
            return
        await s.close()

    def _wrap(self, raw: INetStream, peer: str, name: str) -> FramedStream:
        c = self.config
        return FramedStream(
            raw,
            peer_id=peer,
            protocol=name,
            timeout_s=c.request_timeout_s,
            chunk_timeout_s=c.chunk_timeout_s,
            max_message_bytes=c.max_message_bytes,
            chunk_bytes=c.chunk_bytes,
            limits=c.tensor_limits,
            message_deadline_s=c.message_deadline_s,
            min_rate=c.min_rate_bytes_per_s,
            # The lane dials the peer's IP at another port: only a plain direct connection says where
            # that is. Through a relay the IP is the relay's, and a punched hole is open for one port.
            bulk=self.bulk if self.bulk is not None and self.bulk.port and self.path_to(peer) == "direct" else None,
        )

    # -- calling ------------------------------------------------------------------------------

    @asynccontextmanager
    async def open_stream(self, peer: str, name: str, *, timeout: float | None = None) -> AsyncIterator[FramedStream]:
        """Open a stream of ``/protolearn/<name>/1.0.0`` to ``peer``; reset it if the body raises."""
        pid = await self._ensure_peer(peer)
        peer = str(pid)
        limit = self.config.connect_timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                raw = await self._new_stream(pid, name)
        except trio.TooSlowError:
            raise PeerUnavailable(peer, f"could not open {protocol_id(name)} within {limit:g} s") from None
        s = self._wrap(raw, peer, name)
        try:
            yield s
        except BaseException:
            with trio.CancelScope(shield=True):
                await s.reset()
            raise
        with trio.CancelScope(shield=True):
            await s.close()

    async def _new_stream(self, pid: ID, name: str) -> INetStream:
        # py-libp2p keeps a connection the remote closed in its table and then refuses to redial
        # ("No valid connections"); drop such a connection and try once more on a fresh dial.
        net = self._lp.get_network()
        for attempt in range(2):
            await self._prepare_dial(pid)
            try:
                return await self._lp.new_stream(pid, [protocol_id(name)])  # type: ignore[list-item]
            except (BaseLibp2pError, OSError) as err:
                conns = net.get_connections(pid)
                if attempt == 0 and conns and all(c.is_closed for c in conns):
                    log.info("stream open failed on a closed connection peer=%s reason=%s; redialling", pid, _why(err))
                    continue
                raise PeerUnavailable(str(pid), f"could not open {protocol_id(name)}: {_why(err)}") from None
        raise AssertionError("unreachable")

    async def request(
        self,
        peer: str,
        name: str,
        msg: Message,
        reply_type: type[R] | tuple[type[Message], ...],
        *,
        timeout: float | None = None,
    ) -> R:
        """Send ``msg`` on a new stream and return the reply, all within ``timeout``.

        Raises PeerTimeout (no reply in time), PeerUnavailable (dial or stream failed), Refused (the
        remote answered with an ErrorReply) or ProtocolError (a malformed reply).
        """
        limit = self.config.request_timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                async with self.open_stream(peer, name) as s:
                    await s.send(msg, timeout=limit)
                    return await s.receive(reply_type, timeout=limit)
        except trio.TooSlowError:
            raise PeerTimeout(peer, f"no reply to {msg.KIND} on {name} within {limit:g} s") from None


@asynccontextmanager
async def open_host(
    identity: HasSeed,
    listen: Sequence[str] = (DEFAULT_LISTEN,),
    config: TransportConfig | None = None,
    *,
    clock: Clock = MONOTONIC,
    relay: RelayLimits | None = None,
) -> AsyncIterator[Host]:
    """Build, start and yield a :class:`Host` listening on ``listen``; close everything on exit.

    An error raised in the body comes out as itself, not wrapped in the nurseries' ExceptionGroup.
    A listen address that cannot be used raises :class:`ConfigError`. ``clock`` is the transport's
    one clock (:mod:`protolearn.protocol.transport.clock`): the rejection log's intervals and the
    bulk lane's times are measured in it (``time.monotonic`` unless a test fakes it).
    """
    cfg = TransportConfig() if config is None else config
    key_pair = create_new_key_pair(bytes(identity.private_bytes))
    listen_addrs = [parse_multiaddr(a, "local") for a in listen]
    for addr in listen_addrs:
        check_port_free(addr)
    lp = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)},
        muxer_opt=create_yamux_muxer_option(),
        listen_addrs=listen_addrs,
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        enable_mDNS=False,
        enable_upnp=False,
    )
    host = Host(lp, cfg, clock=clock, relay=relay)
    host.puncher = HolePuncher(lp)
    host.relay.install()
    lp.get_network().register_notifee(_BanNotifee(host))
    # The swarm and the host's services run in a task of their own under a shield, so a cancel from
    # outside (a signal stopping the node) reaches the body but not them: the body's cleanup (a
    # node's goodbye to the coordinator) still has a host. They stop when the body is done, within
    # twice connect_timeout_s. See "Lifetime" in the package docstring.
    stop = trio.Event()
    services = trio.CancelScope(shield=True)
    try:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(_run_services, lp, host, listen_addrs, services, stop)
                if not lp.get_addrs():  # py-libp2p logs a failed listen and carries on
                    raise ConfigError(f"cannot listen on {', '.join(listen)}: use an address of this machine, e.g. /ip4/0.0.0.0/tcp/0")
                yield host
            finally:
                stop.set()
                services.deadline = trio.current_time() + 2 * cfg.connect_timeout_s
    except BaseExceptionGroup as group:
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None
    finally:
        host._flush_logs(everything=True)  # no count is lost at shutdown


async def _run_services(
    lp: IHost,
    host: Host,
    listen_addrs: list[multiaddr.Multiaddr],
    services: trio.CancelScope,
    stop: trio.Event,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the libp2p swarm and the host's own services inside ``services`` until ``stop`` is set."""
    with services:
        async with lp.run(listen_addrs), trio.open_nursery() as nursery:
            try:
                # py-libp2p's auto-connector dials peers from the peerstore to keep about 200
                # connections: every 30 s (every 10 s while below 50) and after each disconnect. Here
                # every dial is on purpose: its background dials to a peer that just died would race
                # ours and mark the peer undialable for 60 s. Its one tick at start-up, before this
                # stop, finds an empty peerstore and dials nothing.
                await lp.get_network().auto_connector.stop()
                await nursery.start(host._disconnect_service)
                await nursery.start(host._rejection_log_service)
                await nursery.start(host.relay.renew)
                if host.puncher is not None:
                    await nursery.start(_run_libp2p_service, host.puncher)
                    host.puncher.install(host)
                host._nursery = nursery
                ip = lane_ip([str(a) for a in listen_addrs])
                if host.bulk is not None and ip is not None:
                    await nursery.start(host.bulk.serve, ip)
                task_status.started()
                await stop.wait()
            finally:
                nursery.cancel_scope.cancel()
                # Close connections explicitly: cancelling the swarm alone leaves sockets to the GC.
                with trio.CancelScope(shield=True), trio.move_on_after(host.config.connect_timeout_s):
                    await lp.close()


async def _run_libp2p_service(service: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run a py-libp2p ``Service`` (DCUtR) until cancelled; started once its ``run`` has registered its
    stream handlers (which :meth:`HolePuncher.install` then replaces with gated ones)."""
    async with background_trio_service(service):
        await service.event_started.wait()
        task_status.started()
        await trio.sleep_forever()


def _is_relayed(conn: INetConn) -> bool:
    muxed = getattr(conn, "muxed_conn", None)
    try:
        kind = muxed.get_connection_type() if muxed is not None else conn.get_connection_type()
    except (BaseLibp2pError, AttributeError):
        kind = None
    return kind == ConnectionType.RELAYED or _tcp_socket(conn) is None


def _log_refusal_summaries(summaries: list[Summary[tuple[str, str]]]) -> None:
    for s in summaries:
        log.info("refused %s protocol=%s reason=%s", s.head(), *s.last)


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside nested single-member groups, else None."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


def _parse_peer_id(text: str) -> ID:
    try:
        return ID.from_base58(text)
    except Exception as err:  # base58 and multihash raise several unrelated types
        raise PeerUnavailable(text[:80], f"invalid peer ID: {err}") from None


async def reset_quietly(raw: INetStream, timeout: float) -> None:
    """Abort ``raw`` in both directions, best effort and bounded: the connection may already be gone."""
    with trio.move_on_after(timeout):
        try:
            await raw.reset()
        except (BaseLibp2pError, OSError):
            pass


def _tcp_socket(conn: INetConn) -> Any:
    """The trio socket under a connection's muxer and security layers, or None (a relayed connection).

    py-libp2p nests it as muxer -> secure session -> (Noise reader/writer ->) raw connection -> trio
    stream -> socket, under attribute names that differ per layer; a bounded walk finds it."""
    obj: Any = getattr(conn, "muxed_conn", None)
    for _ in range(8):
        if obj is None:
            return None
        sock = getattr(obj, "socket", None)
        if sock is not None and hasattr(sock, "getsockname"):
            return sock
        obj = next((getattr(obj, a) for a in ("secured_conn", "conn", "read_writer", "read_write_closer", "stream") if getattr(obj, a, None) is not None), None)
    return None


def _causes(err: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """``err`` and what it wraps: py-libp2p hides a failed dial's reason in a MultiError under its cause."""
    yield err
    if depth >= 8:
        return
    for inner in getattr(err, "errors", None) or ():
        if isinstance(inner, BaseException):
            yield from _causes(inner, depth + 1)
    nested = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    if nested is not None:
        yield from _causes(nested, depth + 1)


def _why(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return text if len(text) <= 300 else text[:300] + "..."
