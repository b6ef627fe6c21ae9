"""The libp2p host: TCP + Noise only + yamux, one object composing the transport's parts.

See the package docstring of :mod:`protolearn.protocol.transport` for the API. :class:`Host` is the
facade the rest of protolearn codes against; each concept behind it has its module: protocol and peer
IDs (:mod:`.names`), dialling (:mod:`.dialing`), serving inbound streams behind the gate
(:mod:`.serving`), bans carried out and the gate's logs (:mod:`.gatekeeper`), what a connection says
about a peer (:mod:`.connections`), py-libp2p's errors (:mod:`.libp2p_errors`), the relay
(:mod:`.relay`), hole punching (:mod:`.holepunch`), the bulk lane (:mod:`.bulk`) and what protolearn changes
in py-libp2p itself (:mod:`.adjustments`). Here remain the
outbound streams and requests, and :func:`open_host`, which runs the swarm in a shielded task of its
own, so that a cancelled ``async with open_host(...)`` block can still use the host in its cleanup (a
node's leave on SIGTERM); "Lifetime" in the package docstring says why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import multiaddr
import trio
from libp2p import create_yamux_muxer_option, new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.config import RetryConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from protolearn.errors import ConfigError
from protolearn.protocol.addresses import DEFAULT_LISTEN, advertised, check_port_free, parse_multiaddr
from protolearn.protocol.dial_book import DialBook
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable
from protolearn.protocol.relay_book import RelayLimits
from protolearn.protocol.transport import adjustments
from protolearn.protocol.transport.bulk import BulkLane, lane_ip
from protolearn.protocol.transport.clock import MONOTONIC, Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.connections import Connections
from protolearn.protocol.transport.dialing import Dialer
from protolearn.protocol.transport.gatekeeper import ConnectionWatch, Gatekeeper
from protolearn.protocol.transport.holepunch import HolePuncher
from protolearn.protocol.transport.inbound import InboundCap, connection_config, install, resource_manager
from protolearn.protocol.transport.peerstore import HostPeerStore
from protolearn.protocol.transport.libp2p_errors import reset_quietly, single_leaf, why
from protolearn.protocol.transport.link import LinkShaper, pumps
from protolearn.protocol.transport.names import parse_peer_id, protocol_id
from protolearn.protocol.transport.relay import Relay
from protolearn.protocol.transport.serving import RawHandler, RequestHandler, Server, StreamHandler
from protolearn.protocol.transport.streams import FramedStream
from protolearn.protocol.wire import Message

log = logging.getLogger("protolearn.protocol")

adjustments.install()  # what protolearn changes in py-libp2p's own behaviour (adjustments.py)
R = TypeVar("R", bound=Message)

# Retries py-libp2p makes inside one dial after its first attempt fails (see open_host).
DIAL_RETRIES = 1


class HasSeed(Protocol):
    @property
    def private_bytes(self) -> bytes: ...


class Host:
    """A running libp2p host. Build it with :func:`open_host`; see the package docstring for the API."""

    def __init__(self, lp: IHost, config: TransportConfig, *, clock: Clock = MONOTONIC, relay: RelayLimits | None = None,
                 puncher: HolePuncher | None = None) -> None:
        self._lp = lp
        self.config = config
        # The transport's one clock (protocol/transport/clock.py): the rejection log's intervals and
        # the bulk lane's offers, marks and chunk deadlines are measured in it; a test may pass a fake.
        self.clock = clock
        self.peer_id = str(lp.get_id())
        self._keeper = Gatekeeper(lp, config, clock)
        self.gate = self._keeper.gate
        self.inbound = InboundCap(config.max_connections_per_ip, config.max_pending_connections, cap_loopback=config.cap_loopback)
        # The emulated access link (config.link): it shapes every TCP connection and the bulk lane.
        self.link = LinkShaper(config.link, clock=clock) if config.link is not None else None
        # None when config.bulk is off; host.bulk.stats counts what went over the lane.
        self.bulk = (
            BulkLane.from_config(config, clock, on_over_limit=self._keeper.bulk_over_limit, link=self.link) if config.bulk else None
        )
        # DCUtR (holepunch.py); ``public_ip`` (below) is the address a punch offers.
        self.puncher = puncher
        self._connections = Connections(lp, puncher)
        self._server = Server(lp, config, self._keeper, self._wrap)
        # The relay protocol: always its client side, the relaying side when ``relay`` limits are given.
        self.relay = Relay(self, relay)
        self._dialer = Dialer(lp, config, self._keeper, self._connections, self.relay, puncher, clock=clock)
        # Told (peer, connected) when a peer connects or its last connection closes (e.g. it died);
        # it runs inside libp2p's notifier, so it must be quick and must not raise.
        self.on_connection: Callable[[str, bool], None] | None = None
        # Tells on_connection; registered with the swarm by open_host, its nursery set once the services run.
        self._watch = ConnectionWatch(self._keeper, self._connection_changed, self.inbound)

    # -- what the host is ---------------------------------------------------------------------

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

    @property
    def punch(self) -> bool:
        """Whether to try a hole punch after opening a circuit (a node whose NAT rewrites ports turns it off)."""
        return self._dialer.punch

    @punch.setter
    def punch(self, on: bool) -> None:
        self._dialer.punch = on

    @property
    def requests_served(self) -> int:
        """Requests this host answered with a normal (non-error) reply."""
        return self._server.requests_served

    def sign(self, data: bytes) -> bytes:
        """Sign ``data`` with this host's identity key (Ed25519, RFC 8032): what peers verify against its peer ID."""
        return self._lp.get_private_key().sign(data)

    # -- dialling and connections (dialing.py, connections.py, relay.py) ----------------------

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember where ``peer_id`` listens, so requests can dial it by ID (relayed addresses too)."""
        self._dialer.add_peer_addrs(peer_id, addrs)

    @property
    def dial_book(self) -> DialBook:
        """The peers whose last dials failed, and when each may be dialled again (see dialing.py)."""
        return self._dialer.book

    def retain_dial_failures(self, peers: Collection[str]) -> None:
        """Forget the failed dials of every peer not in ``peers`` (the coordinator's view of the members):
        one that left and joins again is dialled at once."""
        self._dialer.book.retain(peers)

    async def connect(self, addr: str, *, timeout: float | None = None) -> str:
        """Dial ``addr`` (which must end in ``/p2p/<id>``) and return the peer ID (see :meth:`.Dialer.connect`)."""
        return await self._dialer.connect(addr, timeout=timeout)

    async def reserve(self, relay_addr: str, *, timeout: float) -> str:
        """Reserve a slot on the relay at ``relay_addr``; this host's circuit address through it, which
        peers can dial. Renewed in the background while the host runs. PeerUnavailable or Refused if not."""
        return await self.relay.reserve(relay_addr, timeout=timeout)

    def num_connections(self, peer_id: str) -> int:
        """How many live connections this host has with ``peer_id`` (two: two processes share one identity)."""
        return len(self._connections.live(peer_id))

    def path_to(self, peer_id: str) -> str | None:
        """How this host reaches ``peer_id`` now: "direct", "hole-punched", "relayed", or None."""
        return self._connections.path_to(peer_id)

    def observed_addr(self, peer_id: str) -> tuple[str, int] | None:
        """The (ip, port) that ``peer_id``'s live connection comes from, as this host sees it."""
        return self._connections.observed_addr(peer_id)

    def local_port(self, peer_id: str) -> int | None:
        """This host's own TCP port on its live connection to ``peer_id`` (None if not connected over TCP)."""
        return self._connections.local_port(peer_id)

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id`` (bounded by ``connect_timeout_s``; errors are logged)."""
        await self._keeper.disconnect(peer_id)

    # -- the gate (gatekeeper.py) -------------------------------------------------------------

    def ban(self, peer_id: str, reason: str) -> None:
        """Refuse ``peer_id`` from now on and close its connections."""
        self._keeper.ban(peer_id, reason)

    def unban(self, peer_id: str) -> None:
        self.gate.unban(peer_id)

    def is_banned(self, peer_id: str) -> bool:
        """Banned for good (:meth:`ban`). A temporary ban for repeated abuse is :meth:`ban_reason`'s."""
        return self.gate.is_banned(peer_id)

    def ban_reason(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is refused now: banned for good, or for a while (protocol/gate.py); None if not."""
        return self._keeper.ban_reason(peer_id)

    def active_streams(self, name: str, peer: str | None = None) -> int:
        """How many inbound streams of protocol ``name`` (from ``peer``, if given) are being handled right now."""
        return self.gate.active_streams(name, peer)

    def log_refusal(self, peer: str, name: str, kind: str, reason: str) -> None:
        """Log that this host refused ``peer`` on protocol ``name`` (first in full per interval, then counted)."""
        self._keeper.log_refusal(peer, name, kind, reason)

    # -- serving (serving.py) -----------------------------------------------------------------

    def serve(
        self, name: str, handler: RequestHandler, *, request_type: type[Message] | tuple[type[Message], ...],
        max_inbound: int | None = None, max_bytes: int | None = None, max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        """Answer ``/protolearn/<name>/1.0.0``: one request and one reply per inbound stream (:meth:`.Server.serve`)."""
        self._server.serve(name, handler, request_type=request_type, max_inbound=max_inbound, max_bytes=max_bytes,
                           max_inbound_per_peer=max_inbound_per_peer, known=known, max_inbound_unknown=max_inbound_unknown)

    def serve_stream(
        self, name: str, handler: StreamHandler, *, max_inbound: int | None = None, max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        """Hand each inbound stream of ``/protolearn/<name>/1.0.0`` to ``handler(peer_id, stream)`` (:meth:`.Server.serve_stream`)."""
        self._server.serve_stream(name, handler, max_inbound=max_inbound, max_inbound_per_peer=max_inbound_per_peer, known=known,
                                  max_inbound_unknown=max_inbound_unknown)

    def serve_raw(
        self, pid: str, name: str, handler: RawHandler, *, max_inbound: int | None = None, max_inbound_per_peer: int | None = None,
        known: Callable[[str], bool] | None = None, max_inbound_unknown: int | None = None,
    ) -> None:
        """Hand each inbound stream of libp2p protocol ``pid`` to ``handler(peer_id, raw stream)`` once the gate
        admits it (:meth:`.Server.serve_raw`)."""
        self._server.serve_raw(pid, name, handler, max_inbound=max_inbound, max_inbound_per_peer=max_inbound_per_peer, known=known,
                               max_inbound_unknown=max_inbound_unknown)

    # -- calling ------------------------------------------------------------------------------

    @asynccontextmanager
    async def open_stream(self, peer: str, name: str, *, timeout: float | None = None) -> AsyncIterator[FramedStream]:
        """Open a stream of ``/protolearn/<name>/1.0.0`` to ``peer``; reset it if the body raises."""
        pid = await self._dialer.ensure_peer(peer)
        peer = str(pid)
        limit = self.config.connect_timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                raw = await self._dialer.new_stream(pid, name)
        except trio.TooSlowError:
            self._dialer.dial_timed_out(pid, limit)
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

    async def open_raw_stream(self, peer: str, proto: str) -> INetStream:
        """A raw libp2p stream of ``proto`` to a connected ``peer`` (the relay protocols' own framing)."""
        try:
            return await self._lp.new_stream(parse_peer_id(peer), [proto])  # type: ignore[list-item]
        except (BaseLibp2pError, OSError) as err:
            raise PeerUnavailable(peer, f"could not open {proto}: {why(err)}") from None

    async def close_raw(self, raw: INetStream, *, reset: bool = False) -> None:
        if reset:
            await reset_quietly(raw, self.config.chunk_timeout_s)
            return
        with trio.move_on_after(self.config.chunk_timeout_s):
            try:
                await raw.close()
            except (BaseLibp2pError, OSError):
                pass

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

    def _connection_changed(self, peer: str, connected: bool) -> None:
        if connected:
            self._dialer.book.succeeded(peer)  # it is alive, whoever dialled
        else:
            self.relay.peer_gone(peer)
        if self.on_connection is not None:
            self.on_connection(peer, connected)


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
    peers = HostPeerStore(cfg.max_connections)
    lp = new_host(
        peerstore_opt=peers,
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)},
        muxer_opt=create_yamux_muxer_option(),
        listen_addrs=listen_addrs,
        connection_config=connection_config(cfg),
        resource_manager=resource_manager(cfg),
        enable_mDNS=False,
        enable_upnp=False,
    )
    # py-libp2p retries a failed dial 3 times, 0.1 + 0.2 + 0.4 s apart, inside each dial: a dead peer's dial
    # took 0.7 s to fail (collective probes waited that long) and cost 4 refused TCP attempts. Callers
    # here retry with their own deadlines, and the dial book (dial_book.py) paces redials of a dead peer,
    # so one quick retry is kept for a fluke and the rest is left to them. (new_host() takes no retry_config.)
    lp.get_network().retry_config = RetryConfig(max_retries=DIAL_RETRIES)
    peers.own = lp.get_id()
    if not cfg.identify_peers:
        adjustments.skip_identify(lp)
    host = Host(lp, cfg, clock=clock, relay=relay, puncher=HolePuncher(lp))
    install(lp, host.inbound)
    if host.link is not None:
        host.link.install(lp)
    host.relay.install()
    lp.get_network().register_notifee(host._watch)
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
        leaf = single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None
    finally:
        host._keeper.flush_logs(everything=True)  # no count is lost at shutdown


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
        # The link's pumps stop last: the swarm's connections still flush through them as they close.
        async with pumps(host.link), lp.run(listen_addrs), trio.open_nursery() as nursery:
            try:
                # py-libp2p's auto-connector dials peers from the peerstore to keep about 200
                # connections: every 30 s (every 10 s while below 50) and after each disconnect. Here
                # every dial is on purpose: its background dials to a peer that just died would race
                # ours and mark the peer undialable for 60 s. Its one tick at start-up, before this
                # stop, finds an empty peerstore and dials nothing.
                await lp.get_network().auto_connector.stop()
                await nursery.start(host._keeper.disconnect_service)
                await nursery.start(host._keeper.log_service)
                await nursery.start(host.relay.renew)
                if host.puncher is not None:
                    await nursery.start(_run_libp2p_service, host.puncher)
                    host.puncher.install(host)
                host._dialer.nursery = nursery
                host._watch.nursery = nursery
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


__all__ = ["Host", "HasSeed", "open_host"]
