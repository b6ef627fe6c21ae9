"""The bulk lane: large tensor payloads over a direct TCP connection, sealed with AES-256-GCM.

Why. py-libp2p's yamux and Noise are pure Python: every 64 KiB Noise frame costs a trip through
yamux, Noise, msgio and trio, so a 16 MiB part costs hundreds of Python-level reads and writes, and
four peers sharing two cores spend most of an all-reduce there (profile in issue 6). The lane moves
only the payload bytes of a large tensor; the header, the negotiation and the trailer stay on the
Noise-authenticated libp2p stream, which is what authenticates the lane.

How one tensor travels (see ``FramedStream.send_tensor`` / ``receive_tensor``):

1. The sender's :class:`TensorHeader` says ``bulk=True`` when the payload is at least
   ``bulk_min_bytes``, its lane is on, and the peer's lane was not found unreachable lately.
2. The receiver validates the header against its limits first, then answers on the stream with a
   :class:`~.bulk_offers.BulkOffer`: its lane's port, a fresh random token and a fresh random 256-bit key (the
   stream is Noise-encrypted, so only the authenticated peer learns them), or a :class:`~.bulk_offers.BulkDecline`.
   Offers are bounded in number and expire (:class:`~.bulk_offers.OfferTable`, sans-IO).
3. The sender dials the IP of the existing libp2p connection at that port and writes the token;
   the lane answers with HMAC(key, token), which proves the dial reached the receiver and not some
   other machine (NAT, relay). All that within ``bulk_connect_timeout_s``. The sender then tells the
   receiver on the stream which way the bytes come (:class:`~.bulk_offers.BulkChoice`); when the dial or the
   confirmation failed, the payload goes through the stream as before, and the peer's lane is
   skipped for ``UNREACHABLE_S``.
4. The payload travels in AES-256-GCM sealed chunks (:mod:`protolearn.protocol.transport.seal`): a
   reordered, replayed, cut or altered chunk fails authentication. The receiver knows every chunk's
   length from the validated header, so it reads exactly that and decrypts straight into one buffer
   of the validated size, allocated when the connection arrives (reservations are capped).
5. The trailer follows on the stream, as for an in-stream tensor.

A connection to the lane's port that does not present a pending token within ``HELLO_TIMEOUT_S``
is closed, and at most ``MAX_HELLOS`` such connections are read at once, at most
``max_hellos_per_ip`` from one IP (before its token a connection has no peer id), so one machine
cannot take every slot. Per peer, at most ``max_pending_per_peer`` offers (so as many worker
threads) and ``max_pending_bytes_per_peer`` reserved bytes: past them the peer is declined and sends
in-stream, and the host's gate records it. A whole transfer must finish within
max(``message_deadline_s``, bytes / ``min_rate``), on both sides, so a trickle frees its thread. The chunk loops run in
worker threads on blocking sockets, each chunk under the per-chunk deadline, so crypto and copies
stay off the event loop and the GIL is released in recv/send. (In one process, threads moved
2.8-4.0 GB/s against trio sockets' 1.7-2.1 GB/s; in the 4-peer recovery bench the two were level.)
A cancelled transfer shuts its socket down, which ends the blocked thread at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from protolearn.protocol.errors import PeerTimeout, ProtocolError
from protolearn.protocol.transport.bulk_offers import BulkOffer, Offer, OfferTable
from protolearn.protocol.transport.clock import MONOTONIC, Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.link import LinkShaper
from protolearn.protocol.transport.seal import CHUNK_BYTES, KEY_BYTES, TOKEN_BYTES, confirmation, dial, receive_chunks, send_chunks

HELLO_TIMEOUT_S = 2.0  # a connection must present its token this fast (it has it before it dials)
MAX_HELLOS = 64  # connections read at once before they presented a token; more are closed
UNREACHABLE_S = 60.0  # after a failed dial, a peer's lane is not tried again for this long
MAX_THREADS = 32  # transfers running at once in worker threads, per host

log = logging.getLogger("protolearn.protocol")


# -- the lane: listener, token check, transfers -----------------------------------------------------


@dataclass
class BulkStats:
    """What the lane did; tests and benchmarks read these."""

    num_sent: int = 0  # tensors sent over the lane
    num_received: int = 0  # tensors received over the lane
    num_fallbacks: int = 0  # tensors that went in-stream after asking for the lane
    num_refused: int = 0  # connections closed for a missing, short or unknown token
    refused_reasons: list[str] = field(default_factory=list)


@dataclass
class _Waiter:
    offer: Offer
    arrived: trio.Event = field(default_factory=trio.Event)
    sock: socket.socket | None = None


class BulkLane:
    """One host's lane: a TCP listener for claimed transfers, and the sending side's dial cache.

    Its offer expiry, unreachable marks and chunk deadlines read the time from ``clock``, the host's
    one transport clock (:mod:`protolearn.protocol.transport.clock`).
    """

    def __init__(
        self, *, min_bytes: int, connect_timeout_s: float, max_pending: int, max_pending_bytes: int, offer_ttl_s: float,
        clock: Clock = MONOTONIC, max_pending_per_peer: int | None = None, max_pending_bytes_per_peer: int | None = None,
        max_hellos_per_ip: int = MAX_HELLOS, message_deadline_s: float = math.inf, min_rate: float = math.inf,
        on_over_limit: Callable[[str, str], None] | None = None, link: LinkShaper | None = None,
    ) -> None:
        self.clock = clock
        self.link = link  # the host's emulated link: the lane's bytes pass it too (transport/link.py)
        self.min_bytes = min_bytes
        self.connect_timeout_s = connect_timeout_s
        self.offers = OfferTable(
            max_pending=max_pending, max_bytes=max_pending_bytes, ttl_s=offer_ttl_s,
            max_pending_per_peer=max_pending_per_peer, max_bytes_per_peer=max_pending_bytes_per_peer,
        )
        self.max_hellos_per_ip = max_hellos_per_ip
        self.message_deadline_s = message_deadline_s
        self.min_rate = min_rate
        # Told (peer, reason) when a peer is declined for its own limits: the host records it at its gate.
        self.on_over_limit = on_over_limit
        self._hellos_by_ip: dict[str, int] = {}
        self.stats = BulkStats()
        self.ip = ""
        self.port = 0  # what offers advertise; 0 until the listener runs
        self._waiters: dict[bytes, _Waiter] = {}
        self._unreachable: dict[str, float] = {}  # peer -> time until which its lane is skipped
        self._num_hellos = 0
        # Separate pools: sends wait on remote receivers, so they must never take every receiver's thread.
        self._send_threads = trio.CapacityLimiter(MAX_THREADS)
        self._receive_threads = trio.CapacityLimiter(MAX_THREADS)

    @classmethod
    def from_config(
        cls, config: TransportConfig, clock: Clock, *, on_over_limit: Callable[[str, str], None] | None = None, link: LinkShaper | None = None,
    ) -> BulkLane:
        """The lane of a host with ``config``: its bounds, and an offer lives as long as a chunk may take plus a dial;
        ``link``: the host's emulated link, which the lane's bytes pass too."""
        return cls(
            min_bytes=config.bulk_min_bytes, connect_timeout_s=config.bulk_connect_timeout_s,
            max_pending=config.max_inbound_streams, max_pending_bytes=config.bulk_max_pending_bytes,
            offer_ttl_s=config.chunk_timeout_s + config.bulk_connect_timeout_s, clock=clock,
            max_pending_per_peer=config.bulk_max_pending_per_peer,
            max_pending_bytes_per_peer=config.bulk_max_pending_bytes_per_peer,
            max_hellos_per_ip=config.bulk_max_hellos_per_ip,
            message_deadline_s=config.message_deadline_s, min_rate=config.min_rate_bytes_per_s,
            on_over_limit=on_over_limit, link=link,
        )

    # -- receiving side ---------------------------------------------------------------------------

    async def serve(self, ip: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``ip`` (an ephemeral port) and match each connection's token to a pending offer."""
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with trio.socket.socket(family, socket.SOCK_STREAM) as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await listener.bind((ip, 0))
            listener.listen(128)
            self.ip, self.port = ip, listener.getsockname()[1]
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    try:
                        conn, _ = await listener.accept()  # _: the remote (ip, port)
                    except OSError as err:  # e.g. out of file descriptors: the lane waits, the host goes on
                        log.warning("bulk lane accept failed reason=%s: %s", type(err).__name__, err)
                        await trio.sleep(0.1)
                        continue
                    ip = str(_[0])
                    if self._num_hellos >= MAX_HELLOS:
                        self._refuse(conn, f"more than {MAX_HELLOS} connections waiting to present a token")
                        continue
                    if self._hellos_by_ip.get(ip, 0) >= self.max_hellos_per_ip:
                        self._refuse(conn, f"more than {self.max_hellos_per_ip} connections from {ip} waiting to present a token")
                        continue
                    self._num_hellos += 1
                    self._hellos_by_ip[ip] = self._hellos_by_ip.get(ip, 0) + 1
                    nursery.start_soon(self._hello, conn, ip)

    def total_timeout(self, num_bytes: int) -> float:
        """The whole-transfer deadline of a payload of ``num_bytes``: max(base, bytes / min rate)."""
        return max(self.message_deadline_s, num_bytes / self.min_rate)

    async def _hello(self, conn: trio.socket.SocketType, ip: str) -> None:
        with conn:  # closed on every way out but one: handed over (detached) to the waiting receiver
            try:
                token = b""
                with trio.move_on_after(HELLO_TIMEOUT_S):
                    while len(token) < TOKEN_BYTES:
                        piece = await conn.recv(TOKEN_BYTES - len(token))
                        if not piece:
                            break
                        token += piece
            except OSError as err:
                self._refuse(conn, f"connection broke before its token ({type(err).__name__})")
                return
            finally:
                self._num_hellos -= 1
                left = self._hellos_by_ip[ip] - 1
                if left:
                    self._hellos_by_ip[ip] = left
                else:
                    del self._hellos_by_ip[ip]
            if len(token) < TOKEN_BYTES:
                self._refuse(conn, f"no token within {HELLO_TIMEOUT_S:g} s ({len(token)} of {TOKEN_BYTES} bytes)")
                return
            offer, reason = self.offers.claim(token, self.clock())
            waiter = self._waiters.get(token) if offer is not None else None
            if waiter is None:
                self._refuse(conn, reason or "the offer was given up")
                return
            if self.link is not None:  # this side's share of the dial's two round trips
                await self.link.wait_handshake()
            try:
                with trio.move_on_after(HELLO_TIMEOUT_S):
                    await conn.send(confirmation(offer.key, token))  # 16 bytes: one send takes them
            except OSError as err:
                self._refuse(conn, f"connection broke before its confirmation ({type(err).__name__})")
                return
            if self._waiters.get(token) is not waiter:  # the receiver gave up while we confirmed
                self._refuse(conn, "the offer was given up")
                return
            sock = socket.socket(conn.family, conn.type, fileno=conn.detach())
        sock.setblocking(True)
        waiter.sock = sock
        waiter.arrived.set()

    def _refuse(self, conn: trio.socket.SocketType, reason: str) -> None:
        self.stats.num_refused += 1
        self.stats.refused_reasons = [*self.stats.refused_reasons[-15:], reason]
        log.info("bulk lane closed a connection reason=%s", reason)
        conn.close()

    def offer(self, peer: str, num_bytes: int) -> Offer | str:
        """Make an offer for a validated payload of ``num_bytes``, or say why not."""
        if not self.port:
            return "bulk lane is not listening"
        over = self.offers.over_peer_limit(peer, num_bytes, self.clock())
        if over is not None:
            if self.on_over_limit is not None:
                self.on_over_limit(peer, over)
            return over
        made = self.offers.create(peer, num_bytes, self.clock())
        if isinstance(made, Offer):
            self._waiters[made.token] = _Waiter(made)
        return made

    def withdraw(self, offer: Offer) -> None:
        """Drop an offer whose transfer is over or abandoned, closing a connection nobody took."""
        self.offers.release(offer.token)
        waiter = self._waiters.pop(offer.token, None)
        if waiter is not None and waiter.sock is not None:
            waiter.sock.close()
            waiter.sock = None

    async def receive(self, offer: Offer, *, peer: str, chunk_timeout: float) -> bytearray:
        """Wait for the offer's connection, then read and open its chunks into a new buffer."""
        waiter = self._waiters[offer.token]
        try:
            with trio.move_on_after(chunk_timeout):
                await waiter.arrived.wait()
            if waiter.sock is None:
                raise PeerTimeout(peer, f"bulk lane: no connection with the offered token within {chunk_timeout:g} s")
            out = bytearray(offer.num_bytes)  # the validated size, nothing more
            sock, waiter.sock = waiter.sock, None
            paced = self.link.paced(sock) if self.link is not None else sock
            await _in_thread(
                self._receive_threads, paced, receive_chunks, offer.key, out, peer=peer, chunk_timeout=chunk_timeout, clock=self.clock,
                total_timeout=self.total_timeout(offer.num_bytes),
            )
            if self.link is not None:  # the payload is whole once its last byte has crossed the link
                await self.link.sleep_until(paced.last_arrive)
        finally:
            self.withdraw(offer)
        self.stats.num_received += 1
        return out

    # -- sending side -----------------------------------------------------------------------------

    def wants_lane(self, peer: str, num_bytes: int) -> bool:
        """Whether to ask ``peer`` for the lane for a payload of ``num_bytes``."""
        if num_bytes < self.min_bytes:
            return False
        until = self._unreachable.get(peer)
        if until is not None and until <= self.clock():
            del self._unreachable[peer]
            until = None
        return until is None

    async def connect(self, peer: str, ip: str, offer: BulkOffer) -> socket.socket | str:
        """Dial the offered lane and present the token; on failure, remember it and return the reason."""
        if not (0 < offer.port < 65536) or len(offer.token) != TOKEN_BYTES or len(offer.key) != KEY_BYTES:
            raise ProtocolError(peer, f"malformed bulk offer (port {offer.port}, {len(offer.token)}-byte token, {len(offer.key)}-byte key)")
        try:
            with trio.fail_after(self.connect_timeout_s + 1):
                sock = await _dial_in_thread(self._send_threads, ip, offer.port, offer.token, offer.key, self.connect_timeout_s)
        except (OSError, trio.TooSlowError) as err:
            self._unreachable[peer] = self.clock() + UNREACHABLE_S
            if len(self._unreachable) > 4096:  # bounded: forget the oldest marks
                for old in sorted(self._unreachable, key=self._unreachable.__getitem__)[:1024]:
                    del self._unreachable[old]
            return f"could not reach bulk lane {ip}:{offer.port} ({type(err).__name__}: {err})"[:300]
        if self.link is not None:  # this side's share of the dial's two round trips
            try:
                await self.link.wait_handshake()
            except BaseException:
                sock.close()
                raise
        return sock

    async def send(self, sock: socket.socket, key: bytes, data: memoryview, *, peer: str, chunk_timeout: float) -> None:
        """Send ``data`` sealed with ``key`` on a socket from :meth:`connect` (which this closes)."""
        await _in_thread(
            self._send_threads, self.link.paced(sock) if self.link is not None else sock, send_chunks, key, data, peer=peer, chunk_timeout=chunk_timeout,
            total_timeout=self.total_timeout(len(data)), clock=self.clock,
        )
        self.stats.num_sent += 1


# -- worker threads that own their socket -----------------------------------------------------------
# The thread alone closes its socket, after its last use: were the trio side to close it while the
# thread sits in recv/send, the descriptor could be reused by a new connection and read by the old
# thread. A cancelled transfer only shuts the socket down, which ends the blocked call at once. The
# shutdown and the thread's close take the same lock, so a shutdown never reaches a descriptor
# number that the thread closed and a new connection got again.


async def _in_thread(limiter: trio.CapacityLimiter, sock: socket.socket, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    lock = threading.Lock()
    state = ["new"]  # new -> running -> closed, or new/running -> abandoned (running -> closed after it)

    def job() -> None:
        with lock:
            if state[0] == "abandoned":
                return  # cancelled before it started; the trio side closed the socket
            state[0] = "running"
        try:
            fn(sock, *args, **kwargs)
        finally:
            with lock:
                state[0] = "closed"
                sock.close()

    try:
        await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=limiter)
    except trio.Cancelled:
        with lock:
            was, state[0] = state[0], "abandoned"
            if was == "new":
                sock.close()
            elif was == "running":
                # The peer may have hung up first (a reset): then the socket is no longer connected
                # and shutdown raises ENOTCONN. The blocked call has ended (or will end) on its own.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            # "closed": the thread is done and closed the socket itself.
        raise


async def _dial_in_thread(limiter: trio.CapacityLimiter, ip: str, port: int, token: bytes, key: bytes, timeout: float) -> socket.socket:
    lock = threading.Lock()
    state = ["new"]

    def job() -> socket.socket | None:
        with lock:
            if state[0] == "abandoned":
                return None
        sock = dial(ip, port, token, key, timeout)
        with lock:
            if state[0] == "abandoned":  # nobody will take it
                sock.close()
                return None
            state[0] = "done"
        return sock

    try:
        sock = await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=limiter)
    except trio.Cancelled:
        with lock:
            state[0] = "abandoned"
        raise
    assert sock is not None  # only an abandoned job returns None, and then nobody is here to see it
    return sock


def lane_ip(listen: list[str]) -> str | None:
    """The IP of the first /ip4 or /ip6 listen multiaddr (the lane listens there too), else None."""
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return None


__all__ = ["CHUNK_BYTES", "BulkLane", "BulkStats", "lane_ip"]
