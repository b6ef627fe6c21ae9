"""Circuit relay v2: a node's client side (reserving a slot, dialling through a relay) and the relay's side.

A node behind a NAT cannot accept connections, so it *reserves* a slot on a relay (a coordinator
started with ``--relay``, or a public node joined with ``--relay``) and advertises
``<relay addr>/p2p-circuit/p2p/<its id>``. A peer that dials that address asks the relay to
``CONNECT``; the relay opens a ``STOP`` stream to the reserved node and copies bytes between the two
streams. Noise and yamux then run end to end over that pair of streams, so the relay sees only
ciphertext, and both ends still authenticate each other's peer IDs.

The wire format is libp2p's (``/libp2p/circuit/relay/0.2.0/hop`` and ``.../stop``, protobufs from
py-libp2p), so other libp2p implementations interoperate. The protocol *handling* is our own rather
than py-libp2p's ``CircuitV2Protocol``, because a relay is a service that strangers use and its
limits are the point:

- py-libp2p keys its running circuits by peer, so a second circuit from one source overwrote the
  first one's entry and the first circuit to end closed the other's streams; it trusts the
  ``peer`` field of a RESERVE (one peer can reserve in another's name); its circuit duration is
  checked only when bytes flow, its per-circuit rate limit is never applied, and reservations of
  peers that left keep their slot until they expire (an hour by default), so four departed nodes
  filled its default relay.
- Its client makes a reservation on every relay it dials *through*, so every dialer also takes a
  slot, and its relay discovery rescans only every 300 s.

Here :class:`~protolearn.protocol.relay_book.RelayBook` (sans IO) decides (reservations per relay,
circuits in total, per source and per destination, bytes per circuit), :class:`Relay` does the IO and
enforces each circuit's time limit, and every refusal or cut is
counted against the peer in the host's gate (:mod:`protolearn.protocol.gate`), so a peer that keeps
pushing past its limits is banned for a while and everyone else keeps being served. Both ends'
streams pass the gate before a byte is read, and every read and dial has a deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.connection_types import ConnectionType
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, PeerId, Reservation, StopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from protolearn.protocol.errors import PeerUnavailable, ProtocolError, Refused
from protolearn.protocol.gate import OVER_LIMIT
from protolearn.protocol.relay_book import CIRCUIT, Circuit, RelayBook, RelayLimits, split_circuit


class RelayHost(Protocol):
    """What :class:`Relay` needs of :class:`~protolearn.protocol.transport.host.Host` (which owns it)."""

    peer_id: str
    config: Any
    gate: Any
    libp2p: Any

    def clock(self) -> float: ...
    def path_to(self, peer_id: str) -> str | None: ...
    def observed_addr(self, peer_id: str) -> tuple[str, int] | None: ...
    async def connect(self, addr: str, *, timeout: float | None = None) -> str: ...
    async def open_raw_stream(self, peer: str, proto: str) -> INetStream: ...
    async def close_raw(self, raw: INetStream, *, reset: bool = False) -> None: ...
    def serve_raw(self, pid: str, name: str, handler: Any, *, max_inbound: int | None = None, max_inbound_per_peer: int | None = None) -> None: ...

log = logging.getLogger("protolearn.protocol")

# Relay control messages carry a peer ID, a few addresses and a status: 4 KiB is plenty.
MAX_CONTROL_BYTES = 4096
PUMP_CHUNK = 64 * 1024
# Names under which the gate counts the relay protocols' streams and rejections.
HOP = "relay-hop"
STOP = "relay-stop"


class Relay:
    """The relay protocol on one host: the STOP side (accepting circuits from relays this host reserved
    on, and dialling through them) always, the HOP side (relaying for others) when given limits."""

    def __init__(self, host: RelayHost, limits: RelayLimits | None) -> None:
        self.host = host
        self.book = None if limits is None else RelayBook(limits)
        # Who may reserve, besides the limits: None, or a check that returns why ``peer`` may not (the
        # coordinator admits only nodes its reachability check found private).
        self.admit: Callable[[str], str | None] | None = None
        # relay peer -> (its address as we dialled it, our circuit address through it, renew at)
        self.reservations: dict[str, tuple[str, str, float]] = {}
        self.cut = 0  # circuits this relay cut for going over a limit
        self.refused = 0  # reservations and circuits it refused

    @property
    def relaying(self) -> bool:
        return self.book is not None

    def install(self) -> None:
        cfg = self.host.config
        # STOP streams come only from relays this host reserved on, one per circuit they open to it.
        self.host.serve_raw(STOP_PROTOCOL, STOP, self._on_stop, max_inbound=cfg.max_inbound_streams, max_inbound_per_peer=cfg.max_inbound_streams)
        if self.book is not None:
            lim = self.book.limits
            # A CONNECT's handler runs as long as its circuit: the gate's stream limits bound circuits too.
            self.host.serve_raw(
                HOP_PROTOCOL, HOP, self._on_hop, max_inbound=lim.max_circuits + lim.max_reservations,
                max_inbound_per_peer=lim.max_circuits_per_peer + 2,
            )

    def forget(self, relay: str) -> None:
        """Stop renewing the reservation on ``relay`` (its peer ID): the node moved to another relay."""
        self.reservations.pop(relay, None)

    def peer_gone(self, peer: str) -> None:
        if self.book is not None:
            self.book.release(peer)

    # -- client: reserving and dialling through a relay -------------------------------------

    async def reserve(self, relay_addr: str, *, timeout: float) -> str:
        """Reserve a slot on the relay at ``relay_addr`` (a full address); our circuit address through it."""
        host = self.host
        try:
            with trio.fail_after(timeout):
                relay = await host.connect(relay_addr, timeout=timeout)
                raw = await host.open_raw_stream(relay, HOP_PROTOCOL)
                try:
                    await _write(raw, HopMessage(type=HopMessage.RESERVE))
                    reply = await _read(raw, HopMessage, relay)
                finally:
                    await host.close_raw(raw)
        except trio.TooSlowError:
            raise PeerUnavailable(relay_addr, f"the relay did not answer a reservation within {timeout:g} s") from None
        if reply.type != HopMessage.STATUS or reply.status != StatusCode.OK:
            raise Refused(relay, f"the relay refused a reservation ({_status_name(reply.status)})")
        relay_base = relay_addr.rsplit("/p2p/", 1)[0]
        circuit = f"{relay_base}/p2p/{relay}{CIRCUIT}/p2p/{host.peer_id}"
        ttl = max(reply.reservation.expire - time.time(), 10.0) if reply.HasField("reservation") and reply.reservation.expire else 60.0
        self.reservations[relay] = (relay_addr, circuit, trio.current_time() + ttl / 2)
        log.info("reserved a relay slot relay=%s circuit=%s", relay, circuit)
        return circuit

    async def renew(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep reservations alive: renew each at half its lifetime, and at once after its relay
        connection dropped (a relay that restarted has forgotten us)."""
        task_status.started()
        while True:
            await trio.sleep(2.0)
            for relay, (addr, _, due) in list(self.reservations.items()):
                if trio.current_time() < due and self.host.path_to(relay) is not None:
                    continue
                try:
                    await self.reserve(addr, timeout=self.host.config.connect_timeout_s)
                except ProtocolError as err:
                    log.warning("could not renew the relay reservation relay=%s reason=%s", relay, err.reason)

    async def dial(self, addr: str, *, timeout: float) -> str:
        """Open a relayed connection to the peer behind circuit address ``addr``; its peer ID."""
        host = self.host
        relay_addr, dest = split_circuit(addr, "unknown")
        try:
            dest_id = ID.from_base58(dest)
        except Exception:  # base58 and multihash raise several unrelated types
            raise PeerUnavailable(dest[:80], f"invalid peer ID in relayed address {addr[:200]!r}") from None
        try:
            with trio.fail_after(timeout):
                relay = await host.connect(relay_addr, timeout=timeout)
                raw = await host.open_raw_stream(relay, HOP_PROTOCOL)
                try:
                    await _write(raw, HopMessage(type=HopMessage.CONNECT, peer=PeerId(id=dest_id.to_bytes())))
                    reply = await _read(raw, HopMessage, relay)
                    if reply.type != HopMessage.STATUS or reply.status != StatusCode.OK:
                        raise Refused(dest, f"relay {relay[-8:]} would not connect us ({_status_name(reply.status)})")
                    conn = RawConnection(stream=raw, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[multiaddr.Multiaddr(addr)])
                    await host.libp2p.upgrade_outbound_connection(conn, dest_id)
                except BaseException:
                    await host.close_raw(raw, reset=True)
                    raise
        except trio.TooSlowError:
            raise PeerUnavailable(dest, f"could not connect through the relay within {timeout:g} s") from None
        except (BaseLibp2pError, OSError) as err:
            raise PeerUnavailable(dest, f"the relayed connection failed: {err}") from None
        return dest

    # -- the reserved node's side: a relay brings us a circuit ------------------------------

    async def _on_stop(self, relay: str, raw: INetStream) -> None:
        if relay not in self.reservations:
            self.host.gate.reject(relay, STOP, "Refused", "a circuit from a peer this node holds no reservation on", self.host.clock())
            await self.host.close_raw(raw, reset=True)
            return
        try:
            with trio.fail_after(self.host.config.chunk_timeout_s):
                msg = await _read(raw, StopMessage, relay)
                if msg.type != StopMessage.CONNECT:
                    raise ProtocolError(relay, "expected a STOP CONNECT")
                src = ID(msg.peer.id)
                await _write(raw, StopMessage(type=StopMessage.STATUS, status=StatusCode.OK))
            ma = multiaddr.Multiaddr(f"/p2p/{relay}{CIRCUIT}/p2p/{src}")
            conn = RawConnection(stream=raw, initiator=False, connection_type=ConnectionType.RELAYED, addresses=[ma])
            # Noise authenticates ``src`` during this upgrade; from then on the swarm owns the stream.
            await self.host.libp2p.upgrade_inbound_connection(conn, ma)
        except (trio.TooSlowError, ProtocolError, BaseLibp2pError, OSError, ValueError) as err:
            log.info("relayed connection from relay=%s failed: %s", relay, _failure(err))
            await self.host.close_raw(raw, reset=True)

    # -- the relay's side ----------------------------------------------------------------------

    async def _on_hop(self, peer: str, raw: INetStream) -> None:
        host, book = self.host, self.book
        assert book is not None
        try:
            if host.path_to(peer) == "relayed":
                raise _Deny(StatusCode.PERMISSION_DENIED, "relay requests over a relayed connection are not served")
            with trio.fail_after(host.config.chunk_timeout_s):
                msg = await _read(raw, HopMessage, peer)
            if msg.type == HopMessage.RESERVE:
                # The reservation is for the connection's peer, whatever the message's optional peer field says.
                refusal = None if self.admit is None else self.admit(peer)
                if refusal is not None:
                    raise _Deny(StatusCode.PERMISSION_DENIED, refusal)
                ip = (host.observed_addr(peer) or ("?", 0))[0]
                granted = book.reserve(peer, ip, host.clock(), lambda p: host.path_to(p) is not None)
                if isinstance(granted, str):
                    raise _Deny(StatusCode.RESERVATION_REFUSED, granted)
                reply = HopMessage(
                    type=HopMessage.STATUS, status=StatusCode.OK,
                    reservation=Reservation(expire=int(time.time() + granted - host.clock())), limit=self._limit(),
                )
                with trio.fail_after(host.config.chunk_timeout_s):
                    await _write(raw, reply)
                await host.close_raw(raw)
            elif msg.type == HopMessage.CONNECT:
                await self._connect(peer, raw, msg)
            else:
                raise _Deny(StatusCode.UNEXPECTED_MESSAGE, "expected RESERVE or CONNECT")
        except _Deny as deny:
            self.refused += 1
            host.gate.reject(peer, HOP, OVER_LIMIT, deny.reason, host.clock())
            await self._answer(raw, deny.code)
        except (trio.TooSlowError, ProtocolError, BaseLibp2pError, OSError, ValueError) as err:
            host.gate.reject(peer, HOP, "ProtocolError", _failure(err), host.clock())
            await host.close_raw(raw, reset=True)

    def _limit(self) -> Limit:
        assert self.book is not None
        lim = self.book.limits
        return Limit(duration=int(lim.max_circuit_duration_s), data=lim.max_circuit_bytes)

    async def _answer(self, raw: INetStream, code: StatusCode) -> None:
        """Tell the peer why not, then close (not reset: a reset can overtake the answer)."""
        with trio.move_on_after(1.0):
            try:
                await _write(raw, HopMessage(type=HopMessage.STATUS, status=code))
            except (BaseLibp2pError, OSError):
                pass
        await self.host.close_raw(raw)

    async def _connect(self, src: str, raw: INetStream | None, msg: HopMessage) -> None:
        host, book = self.host, self.book
        assert book is not None
        try:
            dst = str(ID(msg.peer.id))
        except Exception:  # an ID from bytes raises several types
            raise _Deny(StatusCode.MALFORMED_MESSAGE, "the CONNECT names no valid peer") from None
        circuit = book.open(src, dst, host.clock())
        if isinstance(circuit, str):
            raise _Deny(StatusCode.NO_RESERVATION if "no reservation" in circuit else StatusCode.RESOURCE_LIMIT_EXCEEDED, circuit)
        out: INetStream | None = None
        try:
            try:
                with trio.fail_after(host.config.chunk_timeout_s):
                    out = await host.open_raw_stream(dst, STOP_PROTOCOL)
                    await _write(out, StopMessage(type=StopMessage.CONNECT, peer=PeerId(id=ID.from_base58(src).to_bytes()), limit=self._limit()))
                    answer = await _read(out, StopMessage, dst)
                if answer.type != StopMessage.STATUS or answer.status != StatusCode.OK:
                    raise ProtocolError(dst, f"the destination declined the circuit ({_status_name(answer.status)})")
                with trio.fail_after(host.config.chunk_timeout_s):
                    await _write(raw, HopMessage(type=HopMessage.STATUS, status=StatusCode.OK, limit=self._limit()))
            except (trio.TooSlowError, ProtocolError, BaseLibp2pError, OSError) as err:
                log.info("relay could not reach src=%s dst=%s: %s", src, dst, _failure(err))
                await self._answer(raw, StatusCode.CONNECTION_FAILED)
                raw = None
                return
            why = await self._pump(circuit, raw, out)
            if why is not None:
                self.cut += 1
                host.gate.reject(src, HOP, OVER_LIMIT, why, host.clock())
                log.info("relay cut a circuit src=%s dst=%s bytes=%d reason=%s", src, dst, circuit.bytes, why)
        finally:
            book.close(circuit)
            if raw is not None:
                await host.close_raw(raw, reset=True)
            if out is not None:
                await host.close_raw(out, reset=True)

    async def _pump(self, c: Circuit, a: INetStream, b: INetStream) -> str | None:
        """Copy both ways until both sides finished, the circuit ran out of time, or over its bytes
        (both directions count together); the reason it was cut, if it was."""
        assert self.book is not None
        book = self.book
        cut: list[str] = []

        async def copy(src: INetStream, dst: INetStream, scope: trio.CancelScope) -> None:
            try:
                while True:
                    data = await src.read(PUMP_CHUNK)
                    if not data:
                        break
                    why = book.charge(c, len(data))
                    if why is not None:
                        cut.append(why)
                        scope.cancel()
                        return
                    await dst.write(data)
            except (BaseLibp2pError, OSError):
                pass  # this direction ended (EOF, reset or error); the other may still be sending
            try:
                await dst.close()  # half-close: the far end sees EOF
            except (BaseLibp2pError, OSError):
                pass

        with trio.move_on_after(book.limits.max_circuit_duration_s) as timer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, a, b, nursery.cancel_scope)
                nursery.start_soon(copy, b, a, nursery.cancel_scope)
        if timer.cancelled_caught:
            return f"the circuit was open longer than its limit of {book.limits.max_circuit_duration_s:g} s"
        return cut[0] if cut else None


class _Deny(Exception):
    def __init__(self, code: StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _failure(err: BaseException) -> str:
    """What went wrong on a relay stream, in one line: "timed out" for a passed deadline, else the error's reason."""
    return "timed out" if isinstance(err, trio.TooSlowError) else getattr(err, "reason", None) or str(err) or type(err).__name__


def _status_name(status: int) -> str:
    try:
        return StatusCode(status).name
    except ValueError:
        return f"status {status}"


async def _write(raw: INetStream, msg: HopMessage | StopMessage) -> None:
    await raw.write(encode_varint_prefixed(msg.SerializeToString()))


async def _read(raw: INetStream, kind: type[HopMessage] | type[StopMessage], peer: str) -> HopMessage | StopMessage:
    """One length-prefixed control message of at most MAX_CONTROL_BYTES; ProtocolError naming ``peer`` otherwise."""
    try:
        data = await read_varint_prefixed_bytes_limited(raw, MAX_CONTROL_BYTES)
        msg = kind()
        msg.ParseFromString(data)
    except (BaseLibp2pError, OSError) as err:
        raise PeerUnavailable(peer, f"the relay stream ended: {err or type(err).__name__}") from None
    except Exception as err:  # protobuf and varint decoding raise several unrelated types
        raise ProtocolError(peer, f"malformed relay message: {type(err).__name__}: {err}") from None
    return msg


__all__ = ["HOP", "STOP", "Relay"]
