"""The trio side of the link model (:mod:`protolearn.protocol.link`): it only waits for the times the model gives.

One :class:`LinkShaper` per host (``TransportConfig.link``; none when it is unset) shapes all of the
host's traffic in two places:

- **every libp2p connection** over TCP: :meth:`LinkShaper.install` makes the swarm hand each new raw
  TCP connection, inbound or outbound (hole-punched ones too), to a :class:`ShapedConnection` before
  Noise runs on it, so the handshake, yamux and every protocol stream on it are shaped. A relayed
  circuit is not wrapped again: it runs over the (shaped) connection to the relay.
- **the bulk lane** (:mod:`~protolearn.protocol.transport.bulk`): its worker threads send and receive
  through a :class:`PacedSocket`, which takes the lane's bytes through the same two directions.

A :class:`ShapedConnection` has two pumps, tasks in the shaper's nursery. Writing: each write is
offered to the up direction when it is made, which schedules it (serialisation at the rate, FIFO
behind every earlier byte of this host, then the delay), and is queued with its arrival time; the
out-pump writes it to the socket when it is due. The writer waits only while the queue is full
(:func:`queue_cap`, a send buffer), so a pipelined stream pays the delay once and runs at the rate,
and the link's schedule, not the moment a task wakes up, decides when bytes arrive: on a busy
machine a late wake-up delays a delivery a little but costs no rate. Reading: the in-pump reads the
socket as bytes come, stamps each batch with the down direction's arrival time, and ``read`` hands
it out only then; past the cap the in-pump stops reading (TCP then holds the sender back).

The lane's payload takes only the rate on the way out (``PacedSocket`` sleeps until each piece has
left, each offered when the previous one left): its delay is paid by the messages around it on the
shaped stream, since a receiver takes the tensor only with its trailer, which the stream delivers
after the payload's last byte. The receiving side stamps what it receives through its down direction
and waits for the last piece's arrival before it hands the payload over. A lane dial costs two round
trips (TCP's handshake, then the token and its confirmation), and each side waits its own share:
4 × DELAY (:meth:`LinkShaper.wait_handshake`).

When the host stops, the pumps stop last (after the swarm closed its connections); a connection
still used after that reads and writes its socket directly.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, IRawConnection
from libp2p.connection_types import ConnectionType
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from multiaddr import Multiaddr

from protolearn.protocol.link import Link, LinkSpec, Passage
from protolearn.protocol.transport.clock import MONOTONIC, Clock

READ_BYTES = 64 * 1024  # what the in-pump reads at once, and the lane's piece size
FLUSH_S = 2.0  # a closing connection gives its queued bytes this long (plus the delay) to go out

log = logging.getLogger("protolearn.protocol")


def queue_cap(spec: LinkSpec) -> int:
    """Bytes a connection may hold in flight per direction: twice the bandwidth-delay product plus
    256 KiB, so a stream keeps the link full across the delay without an unbounded queue."""
    rate = max(spec.up_bytes_per_s, spec.down_bytes_per_s)
    return 256 * 1024 + int(2 * rate * (spec.delay_s + spec.jitter_s))


@dataclass
class WireStats:
    """Bytes that crossed the link, counted where they meet the socket (libp2p connections, lane)."""

    conn_sent: int = 0
    conn_received: int = 0
    lane_sent: int = 0
    lane_received: int = 0
    connections: int = 0


class LinkShaper:
    """One host's access link. Thread-safe: the lane's worker threads take bytes through it too."""

    def __init__(self, spec: LinkSpec, *, clock: Clock = MONOTONIC) -> None:
        self.spec = spec
        self.clock = clock
        self.link = Link(spec)
        self.stats = WireStats()
        self._lock = threading.Lock()
        self._nursery: trio.Nursery | None = None

    # -- the model, under the lock ------------------------------------------------------------------
    def up(self, n: int, offered: float | None = None) -> Passage:
        with self._lock:
            return self.link.up.send(n, self.clock() if offered is None else offered)

    def down(self, n: int) -> Passage:
        with self._lock:
            return self.link.down.send(n, self.clock())

    def count(self, field: str, n: int) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + n)

    def snapshot(self) -> dict[str, Any]:
        """The link's spec, what each direction carried (model clock) and the wire counters."""
        with self._lock:
            return {
                "spec": self.spec.text, "up": self.link.up.stats.as_dict(), "down": self.link.down.stats.as_dict(),
                "wire": dict(self.stats.__dict__), "clock_now": self.clock(),
            }

    # -- waiting --------------------------------------------------------------------------------------
    async def sleep_until(self, t: float) -> None:
        wait = t - self.clock()
        if wait > 0:
            await trio.sleep(wait)

    def sleep_until_blocking(self, t: float) -> None:
        """The same, in a worker thread (the lane's)."""
        wait = t - self.clock()
        if wait > 0:
            time.sleep(wait)

    async def wait_handshake(self) -> None:
        """This side's share of a new lane connection: two round trips cross this link twice each."""
        if self.spec.delay_s:
            await trio.sleep(4 * self.spec.delay_s)

    # -- wiring ---------------------------------------------------------------------------------------
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the connections' pumps inside this block (the host wraps its swarm in it)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    def install(self, lp: IHost) -> None:
        """Shape every TCP connection the swarm secures from now on, in both directions."""
        upgrader = lp.get_network().upgrader  # type: ignore[attr-defined]
        secure = upgrader.upgrade_security

        async def shaped(raw_conn: IRawConnection, is_initiator: bool, peer_id: Any = None) -> Any:
            return await secure(self.wrap(raw_conn), is_initiator, peer_id)

        upgrader.upgrade_security = shaped

    def wrap(self, raw: IRawConnection) -> IRawConnection:
        """``raw`` shaped, when it is a TCP connection and the pumps run; a relayed circuit as it is."""
        if self._nursery is None or not (isinstance(raw, RawConnection) and isinstance(raw.stream, TrioTCPStream)):
            return raw
        conn = ShapedConnection(raw, self)
        self._nursery.start_soon(conn.pump)
        self.count("connections", 1)
        return conn

    def paced(self, sock: socket.socket) -> PacedSocket:
        return PacedSocket(sock, self)


class ShapedConnection(IRawConnection):
    """A raw TCP connection whose bytes pass the host's link: see the module docstring."""

    def __init__(self, inner: RawConnection, shaper: LinkShaper) -> None:
        self._inner = inner
        # Named like RawConnection's attribute: the host finds the socket by walking ``.stream``s.
        self.stream = inner.stream
        self.is_initiator = inner.is_initiator
        self._shaper = shaper
        self._cap = queue_cap(shaper.spec)
        self._out: deque[tuple[float, bytes]] = deque()
        self._out_bytes = 0
        self._in: deque[tuple[float, bytes | BaseException]] = deque()
        self._in_bytes = 0
        self._out_ready = trio.Event()
        self._out_room = trio.Event()
        self._in_ready = trio.Event()
        self._in_room = trio.Event()
        self._error: BaseException | None = None  # the socket failed under the out-pump
        self._write_lock = trio.Lock()
        self._read_lock = trio.Lock()
        self._scope = trio.CancelScope()
        self._pumping = True
        self._closed = False

    async def pump(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_in)
                    nursery.start_soon(self._pump_out)
        finally:
            self._pumping = False
            for e in (self._out_ready, self._out_room, self._in_ready, self._in_room):
                e.set()

    # -- writing --------------------------------------------------------------------------------------
    async def write(self, data: bytes) -> None:
        async with self._write_lock:
            if self._error is not None:
                raise self._error
            while self._out_bytes >= self._cap and self._pumping and self._error is None:
                self._out_room = trio.Event()
                await self._out_room.wait()
            if self._error is not None:
                raise self._error
            if not self._pumping:
                await self._inner.write(data)
                return
            # Offered now: the link's schedule (FIFO behind every earlier byte of this host) says when it
            # arrives, and the out-pump writes it then. The writer does not sleep until its bytes have
            # left: a late wake-up on a busy machine would idle the link and lose its rate.
            self._out.append((self._shaper.up(len(data)).arrive, bytes(data)))
            self._out_bytes += len(data)
            self._out_ready.set()

    async def _pump_out(self) -> None:
        while True:
            while not self._out:
                self._out_ready = trio.Event()
                await self._out_ready.wait()
            due, data = self._out[0]
            await self._shaper.sleep_until(due)
            try:
                await self._inner.write(data)
            except Exception as err:  # noqa: BLE001 - handed to the next write, which raises it as the socket's own error
                self._error = err
                self._out_room.set()
                return
            self._out.popleft()
            self._out_bytes -= len(data)
            self._shaper.count("conn_sent", len(data))
            self._out_room.set()

    # -- reading --------------------------------------------------------------------------------------
    async def _pump_in(self) -> None:
        while True:
            while self._in_bytes >= self._cap:
                self._in_room = trio.Event()
                await self._in_room.wait()
            try:
                data = await self._inner.read(READ_BYTES)
            except Exception as err:  # noqa: BLE001 - handed to the reader in order, after the bytes before it
                self._in.append((self._shaper.down(0).arrive, err))
                self._in_ready.set()
                return
            self._in.append((self._shaper.down(len(data)).arrive, data))
            self._in_bytes += len(data)
            self._shaper.count("conn_received", len(data))
            self._in_ready.set()
            if not data:
                return  # EOF: delivered after the bytes before it

    async def read(self, n: int | None = None) -> bytes:
        async with self._read_lock:
            while not self._in:
                if not self._pumping:
                    return await self._inner.read(n)
                self._in_ready = trio.Event()
                await self._in_ready.wait()
            due, item = self._in[0]
            await self._shaper.sleep_until(due)
            if isinstance(item, BaseException):
                raise item
            if not item:
                return b""  # EOF stays at the head: every later read sees it too
            if n is None or n >= len(item):
                self._in.popleft()
                chunk = item
            else:
                chunk = item[:n]
                self._in[0] = (due, item[n:])
            self._in_bytes -= len(chunk)
            self._in_room.set()
            return chunk

    # -- the rest of IRawConnection -------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A FIN travels behind the data: let what is queued go out first, boundedly.
        with trio.move_on_after(FLUSH_S + 2 * self._shaper.spec.delay_s):
            while self._out and self._pumping and self._error is None:
                self._out_room = trio.Event()
                await self._out_room.wait()
        self._scope.cancel()
        await self._inner.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._inner.get_remote_address()

    def get_transport_addresses(self) -> list[Multiaddr]:
        return self._inner.get_transport_addresses()

    def get_connection_type(self) -> ConnectionType:
        return self._inner.get_connection_type()


class PacedSocket:
    """A blocking lane socket whose sends and receives wait for the link (used in a worker thread).

    Offers what :mod:`~protolearn.protocol.transport.seal` and the lane's thread wrapper use:
    ``settimeout`` (the deadline of the next ``sendall``/``recv_into``), ``sendall``, ``recv_into``,
    ``shutdown`` and ``close``. ``last_arrive`` is when, on the model's clock, the last received byte
    has arrived.
    """

    def __init__(self, sock: socket.socket, shaper: LinkShaper) -> None:
        self._sock = sock
        self._shaper = shaper
        self._timeout: float | None = None
        self._left: float | None = None  # when the last piece sent had left the link
        self.last_arrive = 0.0

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        clock = self._shaper.clock
        deadline = None if self._timeout is None else clock() + self._timeout
        for start in range(0, len(view), READ_BYTES):
            piece = view[start : start + READ_BYTES]
            # A backlogged sender offers each piece when the previous one has left, not when this thread
            # woke up (later, on a busy machine): the link stays busy at its rate.
            offer = clock() if self._left is None else min(clock(), self._left)
            leave = self._shaper.up(len(piece), offer).leave
            if deadline is not None and leave > deadline:
                raise TimeoutError(f"the link cannot carry {len(view)} bytes within {self._timeout:g} s")
            self._shaper.sleep_until_blocking(leave)
            self._left = leave
            if deadline is not None:
                self._sock.settimeout(max(1e-3, deadline - clock()))
            self._sock.sendall(piece)
            self._shaper.count("lane_sent", len(piece))

    def recv_into(self, buffer: memoryview | bytearray) -> int:
        """Receive as bytes come; each batch is stamped with its arrival through the down direction (the
        buffer holds the validated size anyway, and the lane waits for the last arrival before it hands
        the payload over), so a receiver's late wake-up costs no rate."""
        view = memoryview(buffer)
        k = self._sock.recv_into(view[:READ_BYTES])
        if k:
            self.last_arrive = self._shaper.down(k).arrive
            self._shaper.count("lane_received", k)
        return k

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()


def pumps(shaper: LinkShaper | None) -> Any:
    """``shaper.running()``, or a block that does nothing for an unshaped host."""
    return shaper.running() if shaper is not None else nullcontext()

__all__ = ["LinkShaper", "PacedSocket", "ShapedConnection", "WireStats", "pumps", "queue_cap"]
