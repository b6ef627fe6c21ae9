"""Dialling a peer: where it can be reached, and the py-libp2p habits a redial must undo first.

A host remembers where it was told a peer listens (a full address dialled, or ``add_peer_addrs``):
direct addresses, and relayed ones (``<relay>/p2p/<relay id>/p2p-circuit/p2p/<id>``), which the swarm
cannot dial, so a peer known only by those is dialled through its relay (:mod:`.relay`) and, once, in
the background, hole-punched to a direct connection (:mod:`.holepunch`). At most ``MAX_KNOWN_PEERS``
peers are remembered, the least recently told forgotten first (a coordinator's reachability checker
dials every joiner once).

Three py-libp2p 0.8.1 behaviours would leave a peer that restarts unreachable, so before each dial
:meth:`Dialer.prepare` undoes them: it refuses any dial for 60 s after a failed one (the dialer forgets
that failure; callers have their own deadlines and retries), it keeps a connection the remote closed and
then refuses to redial ("No valid connections"; the dialer drops it), and identify replaces the
addresses we dialled with the ones the peer advertises (``/ip4/0.0.0.0/...`` for a wildcard listener,
which another machine cannot dial; the dialer restores the ones it was given).

Undoing py-libp2p's 60 s refusal leaves the dialer a policy of its own for dead peers: a
:class:`~protolearn.protocol.dial_book.DialBook`. A dial by peer ID (:meth:`Dialer.new_stream` when no
connection is open) of a peer whose last dials failed waits out a short back-off, refused at once with
the reason, so that the callers that keep wanting a dead replica until the coordinator drops it (spot
checks, gradients, probes) dial it a few times, not ten times a second. An explicit
:meth:`Dialer.connect` to a full address is the caller's own retry policy (the coordinator link, a
join): it is never refused, only recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey

from protolearn.protocol.addresses import parse_multiaddr, strip_p2p
from protolearn.protocol.dial_book import DialBook
from protolearn.protocol.errors import PeerUnavailable, ProtocolError, Refused, WrongPeer
from protolearn.protocol.relay_book import is_circuit, split_circuit
from protolearn.protocol.transport.clock import MONOTONIC, Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.connections import Connections
from protolearn.protocol.transport.gatekeeper import Gatekeeper
from protolearn.protocol.transport.holepunch import HolePuncher
from protolearn.protocol.transport.libp2p_errors import causes, why
from protolearn.protocol.transport.names import parse_peer_id, protocol_id
from protolearn.protocol.transport.relay import Relay

log = logging.getLogger("protolearn.protocol")

# Peers whose dial addresses a host keeps (see Dialer._remember).
MAX_KNOWN_PEERS = 16384
# How long a peer's address stays in the peerstore after connect/add_peer_addrs (seconds).
ADDR_TTL_S = 3600


class Dialer:
    """Where host ``lp`` can reach its peers, and how it dials them. ``punch``: try a hole punch after
    opening a circuit (a node whose NAT rewrites ports turns it off); ``nursery``: where the punch runs,
    set while the host's services run."""

    def __init__(self, lp: IHost, config: TransportConfig, keeper: Gatekeeper, connections: Connections, relay: Relay,
                 puncher: HolePuncher | None, *, clock: Clock = MONOTONIC, book: DialBook | None = None) -> None:
        self._lp = lp
        self._clock = clock
        # The peers whose last dials failed, and when to try them again (see the module docstring).
        self.book = DialBook() if book is None else book
        self.config = config
        self._keeper = keeper
        self._connections = connections
        self._relay = relay
        self._puncher = puncher
        self.punch = True
        self.nursery: trio.Nursery | None = None
        # Where we were told a peer listens (a full address dialled, or add_peer_addrs). A peer's
        # identify replaces our peerstore entry with what it advertises, which for a 0.0.0.0 listener
        # is /ip4/0.0.0.0/..., useless from another machine; a redial goes back to these.
        self._dial_addrs: dict[str, list[multiaddr.Multiaddr]] = {}
        # Relayed addresses (<relay>/p2p/<relay id>/p2p-circuit/p2p/<id>) we were given for a peer: the
        # swarm cannot dial them, so a peer with only these is dialled through its relay (relay.py).
        self._circuit_addrs: dict[str, list[str]] = {}

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember where ``peer_id`` listens, so requests can dial it by ID (relayed addresses too)."""
        pid = parse_peer_id(peer_id)
        circuits = [a for a in addrs if is_circuit(a)]
        for a in circuits:
            split_circuit(a, peer_id)  # a malformed one raises here, naming the peer
        maddrs = [strip_p2p(parse_multiaddr(a, peer_id)) for a in addrs if not is_circuit(a)]
        if maddrs != self._dial_addrs.get(str(pid), maddrs) or circuits != self._circuit_addrs.get(str(pid), circuits):
            self.book.forget(str(pid))  # it moved (rejoined elsewhere): failures at the old addresses say nothing
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
        if (reason := self._keeper.ban_reason(peer)) is not None:
            raise Refused(peer, f"not connecting: peer is banned ({reason})")
        limit = self.config.connect_timeout_s if timeout is None else timeout
        self._remember(peer, [strip_p2p(maddr)], self._circuit_addrs.get(peer, []))
        try:
            with trio.fail_after(limit):
                await self.prepare(info.peer_id)
                await self._lp.connect(info)
        except trio.TooSlowError:
            self.book.failed(peer, self._clock(), f"no connection within {limit:g} s")
            raise PeerUnavailable(peer, f"could not connect to {addr} within {limit:g} s") from None
        except (BaseLibp2pError, OSError) as err:
            self.book.failed(peer, self._clock(), why(err))
            if any(isinstance(e, PeerIDMismatchesPubkey) for e in causes(err)):
                raise WrongPeer(peer, f"{strip_p2p(maddr)} answered with another peer id than {peer}") from None
            raise PeerUnavailable(peer, f"could not connect to {addr}: {why(err)}") from None
        except PeerUnavailable as err:  # from prepare(): no relay reached it
            self.book.failed(peer, self._clock(), err.reason)
            raise
        self.book.succeeded(peer)
        return peer

    async def ensure_peer(self, peer: str) -> ID:
        """The ID of ``peer`` (a peer ID, or a full address, which is dialled first), unless it is banned."""
        if peer.startswith("/"):
            peer = await self.connect(peer)
        pid = parse_peer_id(peer)
        if (reason := self._keeper.ban_reason(peer)) is not None:
            raise Refused(peer, f"peer is banned ({reason})")
        return pid

    async def new_stream(self, pid: ID, name: str) -> INetStream:
        """A new stream of ``/protolearn/<name>/1.0.0`` to ``pid``, dialling it first if need be.

        A dial the book (:class:`DialBook`) holds back raises :class:`PeerUnavailable` at once; a dial
        that fails is entered in it."""
        peer = str(pid)
        if not self.connected(pid) and (reason := self.book.refusal(peer, self._clock())) is not None:
            # A checkpoint first: a caller that retries on this error in a loop must not starve the event
            # loop (heartbeats) while the refusal costs no I/O.
            await trio.lowlevel.checkpoint()
            raise PeerUnavailable(peer, reason)
        try:
            stream = await self._new_stream(pid, name)
        except PeerUnavailable as err:
            if not self.connected(pid):  # not reached at all (a stream refused on a live connection is no dial failure)
                self.book.failed(peer, self._clock(), err.reason)
            raise
        self.book.succeeded(peer)
        return stream

    def dial_timed_out(self, pid: ID, limit: float) -> None:
        """A caller's deadline for :meth:`new_stream` passed: a failed dial, unless a connection is open."""
        if not self.connected(pid):
            self.book.failed(str(pid), self._clock(), f"no connection within {limit:g} s")

    def connected(self, pid: ID) -> bool:
        """Whether an open connection to ``pid`` exists (a new stream then needs no dial)."""
        return any(not c.is_closed for c in self._lp.get_network().get_connections(pid))

    async def _new_stream(self, pid: ID, name: str) -> INetStream:
        # py-libp2p keeps a connection the remote closed in its table and then refuses to redial
        # ("No valid connections"); drop such a connection and try once more on a fresh dial.
        net = self._lp.get_network()
        for attempt in range(2):
            await self.prepare(pid)
            try:
                return await self._lp.new_stream(pid, [protocol_id(name)])  # type: ignore[list-item]
            except (BaseLibp2pError, OSError) as err:
                conns = net.get_connections(pid)
                if attempt == 0 and conns and all(c.is_closed for c in conns):
                    log.info("stream open failed on a closed connection peer=%s reason=%s; redialling", pid, why(err))
                    continue
                raise PeerUnavailable(str(pid), f"could not open {protocol_id(name)}: {why(err)}") from None
        raise AssertionError("unreachable")

    async def prepare(self, pid: ID) -> None:
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
            try:
                store.clear_addrs(pid)
            except PeerStoreError:
                # py-libp2p 0.8.1 raises "peer ID is expired" while clearing the addresses of a peer whose
                # entry expired (it looks them up to drop its signed record): they are gone, as wanted.
                pass
            store.add_addrs(pid, known, ADDR_TTL_S)

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
        if (reason := self._keeper.ban_reason(peer)) is not None:
            raise Refused(peer, f"not connecting: peer is banned ({reason})")
        known = self._circuit_addrs.get(peer, [])
        if addr not in known:
            self._remember(peer, self._dial_addrs.get(peer, []), [addr, *known])
        if self._connections.path_to(peer) is not None:
            return peer
        await self._relay.dial(addr, timeout=self.config.connect_timeout_s if timeout is None else timeout)
        if self.punch and self._puncher is not None and self.nursery is not None:
            self.nursery.start_soon(self._puncher.punch, peer)
        return peer

    async def _dial_relayed(self, pid: ID) -> bool:
        """If ``pid`` is known only by relayed addresses and not connected, dial it through a relay.

        The swarm cannot dial those addresses, and it would otherwise dial the private addresses the
        peer's identify put in the peerstore (unreachable behind its NAT, a stall until the deadline)."""
        peer = str(pid)
        circuits = self._circuit_addrs.get(peer)
        if not circuits or self._dial_addrs.get(peer) or self._connections.path_to(peer) is not None:
            return False
        self._lp.get_peerstore().clear_addrs(pid)
        reason = "no relayed address"
        for addr in list(circuits):
            try:
                await self._connect_circuit(addr, None)
                return True
            except ProtocolError as err:
                reason = err.reason
        raise PeerUnavailable(peer, f"could not reach it through any relay: {reason}")


__all__ = ["ADDR_TTL_S", "MAX_KNOWN_PEERS", "Dialer"]
