"""Framed messages and chunked tensors on one libp2p stream, every wait under a deadline.

:class:`FramedStream` wraps a libp2p stream (yamux over Noise). A message travels as
``wire.frame``: an 8-byte big-endian length then the msgpack envelope, and the length is checked
against ``max_message_bytes`` before a single body byte is read. A tensor travels as three parts:

1. a :class:`TensorHeader` message (codec, dtype, shape, side data, and the payload's byte count),
2. the payload's raw bytes, written in slices of at most ``chunk_bytes``, each under the chunk deadline,
3. a :class:`TensorTrailer` message repeating the byte count.

A payload of at least ``bulk_min_bytes`` between two hosts with the bulk lane on takes step 2 over
a direct, AEAD-sealed TCP connection instead (negotiated on this stream right after the header; see
:mod:`protolearn.protocol.transport.bulk`), and falls back to the stream when that cannot be set up.

The receiver checks the header against its :class:`~protolearn.protocol.frames.TensorLimits` and its
expected dtype/shape *before* reading the payload, reads exactly the declared count (never more), and
only then builds the :class:`~protolearn.protocol.frames.TensorFrame`.

Whole-message deadlines (issue 12). Per-read deadlines alone let a peer hold a stream for ever by
sending a byte now and then. So once a message's length prefix (or a tensor's header) has arrived,
its N bytes must arrive in full within max(``message_deadline_s``, N / ``min_rate``), on top of the
per-read and per-chunk deadlines; a stream past that raises :class:`PeerTimeout` naming the peer. libp2p reports a crashed peer
as a plain EOF, so an EOF before the declared count is reported as ``PeerUnavailable("stream ended
mid-...")``; a peer that stops sending is caught by the deadline (``PeerTimeout``).

This module and :mod:`protolearn.protocol.transport` are the only ones in ``protocol/`` that touch
trio or libp2p.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import trio
from libp2p.abc import INetStream
from libp2p.exceptions import BaseLibp2pError

from protolearn.protocol import wire
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError, Refused, TooLarge
from protolearn.protocol.frames import DEFAULT_LIMITS, TensorFrame, TensorLimits, check_frame_header
from protolearn.protocol.transport.bulk import BulkLane
from protolearn.protocol.transport.bulk_offers import BulkChoice, BulkDecline, BulkOffer, Offer
from protolearn.protocol.wire import ErrorReply, Message

if TYPE_CHECKING:  # the transport never needs torch itself: importing it costs seconds at startup
    import torch

M = TypeVar("M", bound=Message)
# Side data of a codec (scales, indices) rides in the header message, so it is bounded by that.
MAX_AUX_BYTES = 16 * 1024 * 1024


class TensorHeader(Message):
    """Announces a tensor: what it decodes to and how many payload bytes follow."""

    KIND: ClassVar[str] = "tensor_header"
    codec: str
    dtype: str
    shape: list[int]
    data_bytes: int
    aux: bytes = b""
    bulk: bool = False  # the sender asks for the bulk lane: the receiver answers BulkOffer or BulkDecline


class TensorTrailer(Message):
    """Ends a tensor; repeats the byte count so a mangled stream cannot end a tensor by accident."""

    KIND: ClassVar[str] = "tensor_trailer"
    data_bytes: int


class FramedStream:
    """One libp2p stream carrying length-prefixed messages and chunked tensors.

    ``timeout`` arguments default to the stream's ``timeout_s`` for messages (the whole message) and
    ``chunk_timeout_s`` for tensors (each chunk). ``raw`` is the underlying libp2p stream, for tests
    and benchmarks that need to write bytes the framing would never produce.
    """

    def __init__(
        self,
        stream: INetStream,
        *,
        peer_id: str,
        protocol: str,
        timeout_s: float,
        chunk_timeout_s: float,
        max_message_bytes: int,
        chunk_bytes: int,
        limits: TensorLimits = DEFAULT_LIMITS,
        bulk: BulkLane | None = None,
        message_deadline_s: float = math.inf,
        min_rate: float = math.inf,
    ) -> None:
        self.raw = stream
        self.bulk = bulk
        self.peer_id = peer_id
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes
        self.limits = limits
        self.message_deadline_s = message_deadline_s
        self.min_rate = min_rate
        self.bytes_received = 0
        self.bytes_sent = 0
        self.finished = False  # closed or reset: a later close() does nothing
        self._was_reset = False

    # -- raw IO ------------------------------------------------------------------------------

    async def _read_exact(self, n: int, *, what: str, chunk_timeout: float | None = None) -> bytes:
        """Read exactly ``n`` bytes; reads never ask for more than what is still owed."""
        pieces: list[bytes] = []
        got = 0
        while got < n:
            want = min(n - got, self.chunk_bytes)
            try:
                if chunk_timeout is None:
                    piece = await self.raw.read(want)
                else:
                    with trio.fail_after(chunk_timeout):
                        piece = await self.raw.read(want)
            except trio.TooSlowError:
                raise PeerTimeout(self.peer_id, f"no data for {chunk_timeout:g} s in {what} on {self.protocol}") from None
            except (BaseLibp2pError, OSError, EOFError) as err:
                raise PeerUnavailable(self.peer_id, self._broken(err, what, got, n)) from None
            if not piece:
                raise PeerUnavailable(self.peer_id, f"stream ended mid-{what} after {got} of {n} bytes on {self.protocol}")
            if len(piece) > want:  # a muxer bug must not make us hold more than we validated
                raise ProtocolError(self.peer_id, f"read returned {len(piece)} bytes, asked for {want}")
            pieces.append(piece)
            got += len(piece)
            self.bytes_received += len(piece)  # counted as it arrives: a cut-off message still shows it began
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _broken(self, err: BaseException, what: str, got: int, n: int) -> str:
        kind = type(err).__name__
        if isinstance(err, EOFError):
            return f"stream ended mid-{what} after {got} of {n} bytes on {self.protocol}"
        return f"stream broke ({kind}) in {what} after {got} of {n} bytes on {self.protocol}"

    async def _write(self, data: bytes | memoryview, *, what: str) -> None:
        try:
            await self.raw.write(data)  # type: ignore[arg-type]  # yamux slices it; a memoryview avoids a copy
        except (BaseLibp2pError, OSError) as err:
            raise PeerUnavailable(self.peer_id, f"stream broke ({type(err).__name__}) while sending {what} on {self.protocol}") from None
        self.bytes_sent += len(data)

    # -- messages ----------------------------------------------------------------------------

    async def send(self, msg: Message, *, timeout: float | None = None) -> None:
        """Send one message (length-prefixed envelope) within the deadline."""
        data = wire.frame(msg, max_bytes=self.max_message_bytes)
        limit = self.timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                await self._write(data, what=f"a {msg.KIND} message")
        except trio.TooSlowError:
            raise PeerTimeout(self.peer_id, f"could not send {msg.KIND} within {limit:g} s on {self.protocol}") from None

    def whole_deadline(self, num_bytes: int, base: float | None = None) -> float:
        """Seconds the ``num_bytes`` of one message or payload may take in all: max(base, bytes / min rate),
        where the base is ``message_deadline_s`` or the caller's shorter one."""
        base = self.message_deadline_s if base is None else min(base, self.message_deadline_s)
        return max(base, num_bytes / self.min_rate)

    async def receive(self, expect: type[M] | tuple[type[Message], ...], *, timeout: float | None = None) -> M:
        """Receive one message of an expected kind: it must start (its length) within ``timeout`` and
        its body must follow within :meth:`whole_deadline` (``timeout`` at most as its base, so a
        small message keeps the caller's deadline), so a trickle cannot stretch it.

        A remote ``ErrorReply`` raises :class:`Refused` with the remote's code and reason.
        """
        limit = self.timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                prefix = await self._read_exact(wire.LENGTH_PREFIX.size, what="message length")
        except trio.TooSlowError:
            raise PeerTimeout(self.peer_id, f"no complete message within {limit:g} s on {self.protocol}") from None
        n = wire.parse_length(prefix, peer=self.peer_id, max_bytes=self.max_message_bytes)
        whole = self.whole_deadline(n, limit)
        try:
            with trio.fail_after(whole):
                body = await self._read_exact(n, what="message")
        except trio.TooSlowError:
            raise PeerTimeout(self.peer_id, f"no complete message within {whole:g} s on {self.protocol} (its {n} bytes came too slowly)") from None
        msg = wire.decode(body, peer=self.peer_id, expect=expect)
        if isinstance(msg, ErrorReply) and not _expects_error(expect):
            raise Refused(self.peer_id, f"{msg.code}: {msg.reason[:200]}")
        return msg  # type: ignore[return-value]

    # -- tensors -----------------------------------------------------------------------------

    async def send_tensor(self, frame: TensorFrame, *, chunk_timeout: float | None = None) -> None:
        """Send a tensor frame as header, payload chunks and trailer, each chunk under the deadline."""
        limit = self.chunk_timeout_s if chunk_timeout is None else chunk_timeout
        data = frame.data
        ip = self._remote_ip() if self.bulk is not None and self.bulk.wants_lane(self.peer_id, len(data)) else None
        header = TensorHeader(codec=frame.codec, dtype=frame.dtype, shape=frame.shape, data_bytes=len(data), aux=frame.aux, bulk=ip is not None)
        await self.send(header, timeout=limit)
        view = memoryview(data)
        if ip is not None and await self._send_bulk(ip, view, limit):
            await self.send(TensorTrailer(data_bytes=len(data)), timeout=limit)
            return
        for start in range(0, len(data), self.chunk_bytes):
            try:
                with trio.fail_after(limit):
                    await self._write(view[start : start + self.chunk_bytes], what="a tensor chunk")
            except trio.TooSlowError:
                raise PeerTimeout(self.peer_id, f"tensor chunk not accepted within {limit:g} s on {self.protocol}") from None
        await self.send(TensorTrailer(data_bytes=len(data)), timeout=limit)

    async def _send_bulk(self, ip: str, view: memoryview, limit: float) -> bool:
        """Ask for the lane and send the payload over it; False: the caller sends it in-stream."""
        assert self.bulk is not None
        reply = await self.receive((BulkOffer, BulkDecline), timeout=limit)
        if isinstance(reply, BulkDecline):
            self.bulk.stats.num_fallbacks += 1
            return False
        sock = await self.bulk.connect(self.peer_id, ip, reply)
        if isinstance(sock, str):
            self.bulk.stats.num_fallbacks += 1
            await self.send(BulkChoice(lane=False, reason=sock), timeout=limit)
            return False
        try:
            await self.send(BulkChoice(lane=True), timeout=limit)
        except BaseException:
            sock.close()
            raise
        await self.bulk.send(sock, reply.key, view, peer=self.peer_id, chunk_timeout=limit)
        self.bytes_sent += len(view)
        return True

    def _remote_ip(self) -> str | None:
        """The IP of this stream's connection (where the peer's lane listens), or None if unknown."""
        try:
            addr = self.raw.get_remote_address()
        except (BaseLibp2pError, OSError, AttributeError):
            return None
        return addr[0] if addr else None

    async def receive_tensor(
        self,
        *,
        codec: str | None = None,
        dtype: torch.dtype | None = None,
        shape: list[int] | tuple[int, ...] | None = None,
        limits: TensorLimits | None = None,
        chunk_timeout: float | None = None,
        admit: Callable[[TensorHeader], None] | None = None,
    ) -> TensorFrame:
        """Receive one tensor frame; its header is validated before any payload byte is read.

        ``codec``/``dtype``/``shape`` are what the protocol expects (None: anything within limits).
        ``admit``, if given, sees the validated header before the payload is read and may raise (a
        :class:`ProtocolError`, e.g. a per-peer buffer limit) to refuse it; it runs without a
        checkpoint in between, so a reservation it makes cannot race another stream's.
        For the ``none`` codec the payload must be exactly numel × element size. Finiteness is the
        caller's check (``tensors.from_frame(require_finite=True)`` or the codec's decode).
        """
        lim = self.limits if limits is None else limits
        limit = self.chunk_timeout_s if chunk_timeout is None else chunk_timeout
        header = await self.receive(TensorHeader, timeout=limit)
        self._check_header(header, lim, codec=codec, dtype=dtype, shape=shape)
        if admit is not None:
            admit(header)
        data: bytes | bytearray | None = await self._receive_bulk(header, limit) if header.bulk else None
        if data is None and header.data_bytes:
            whole = self.whole_deadline(header.data_bytes)
            try:
                with trio.fail_after(whole):
                    data = await self._read_exact(header.data_bytes, what="tensor", chunk_timeout=limit)
            except trio.TooSlowError:
                raise PeerTimeout(
                    self.peer_id, f"tensor of {header.data_bytes} bytes not complete within {whole:g} s on {self.protocol} (too slow)",
                ) from None
        elif data is None:
            data = b""
        trailer = await self.receive(TensorTrailer, timeout=limit)
        if trailer.data_bytes != header.data_bytes:
            raise ProtocolError(self.peer_id, f"tensor trailer says {trailer.data_bytes} bytes, header said {header.data_bytes}")
        # The payload was validated above; skipping a second validation avoids copying MiBs again. A lane
        # payload stays the bytearray it was decrypted into (the receiver owns it; bytes() would copy it).
        return TensorFrame.model_construct(codec=header.codec, dtype=header.dtype, shape=header.shape, data=data, aux=header.aux)

    async def _receive_bulk(self, header: TensorHeader, limit: float) -> bytearray | None:
        """Answer a lane request; the payload if it came over the lane, None if it comes in-stream."""
        offer: Offer | str = "bulk lane is off here" if self.bulk is None else self.bulk.offer(self.peer_id, header.data_bytes)
        if isinstance(offer, str):
            await self.send(BulkDecline(reason=offer), timeout=limit)
            return None
        assert self.bulk is not None
        try:
            await self.send(BulkOffer(port=self.bulk.port, token=offer.token, key=offer.key), timeout=limit)
            choice = await self.receive(BulkChoice, timeout=limit)
            if not choice.lane:
                return None
            data = await self.bulk.receive(offer, peer=self.peer_id, chunk_timeout=limit)
        finally:
            self.bulk.withdraw(offer)
        self.bytes_received += len(data)
        return data

    def _check_header(
        self,
        header: TensorHeader,
        lim: TensorLimits,
        *,
        codec: str | None,
        dtype: torch.dtype | None,
        shape: list[int] | tuple[int, ...] | None,
    ) -> None:
        peer = self.peer_id
        if codec is not None and header.codec != codec:
            raise ProtocolError(peer, f"tensor codec {header.codec[:32]!r} but {codec!r} was expected")
        if header.data_bytes < 0:
            raise ProtocolError(peer, f"negative tensor size {header.data_bytes}")
        if len(header.aux) > MAX_AUX_BYTES:
            raise TooLarge(peer, f"tensor side data of {len(header.aux)} bytes exceeds {MAX_AUX_BYTES}")
        if header.data_bytes + len(header.aux) > lim.max_bytes:
            raise TooLarge(peer, f"declared tensor of {header.data_bytes} bytes exceeds the limit of {lim.max_bytes}")
        want = None
        if dtype is not None:
            # The caller holds a torch dtype, so torch is loaded already and this import is cheap.
            from protolearn.protocol.tensors import DTYPE_NAMES

            want = DTYPE_NAMES.get(dtype, str(dtype))
        # check_frame_header validates dtype, shape, element count and expectations; it only reads aux's length.
        probe = TensorFrame.model_construct(codec=header.codec, dtype=header.dtype, shape=header.shape, data=b"", aux=header.aux)
        item_bytes = check_frame_header(probe, peer=peer, limits=lim, dtype=want, shape=shape)
        if header.codec == "none":
            expected = probe.numel() * item_bytes
            if header.data_bytes != expected or header.aux:
                raise ProtocolError(peer, f"raw tensor declares {header.data_bytes} bytes, shape {header.shape} {header.dtype} needs {expected}")

    # -- lifecycle ---------------------------------------------------------------------------

    async def drain(self, max_bytes: int) -> None:
        """Discard what the peer still sends, up to its EOF or ``max_bytes``; the caller bounds the time.

        Used before resetting a stream we answered with an error: yamux drops data that is still
        unread when a reset arrives, so resetting at once could lose the error reply.
        """
        left = max_bytes
        while left > 0:
            try:
                piece = await self.raw.read(min(left, 64 * 1024))
            except (BaseLibp2pError, OSError, EOFError):
                return  # EOF or reset: the peer is done
            if not piece:
                return
            left -= len(piece)

    async def close(self) -> None:
        """Half-close: tell the peer we are done sending (the peer sees a clean EOF)."""
        if self.finished:
            return
        self.finished = True
        try:
            with trio.move_on_after(self.chunk_timeout_s):
                await self.raw.close()
        except (BaseLibp2pError, OSError):
            # The peer is gone already; there is nothing left to tell it.
            await self.reset()

    async def reset(self) -> None:
        """Abort the stream in both directions."""
        if self._was_reset:
            return
        self._was_reset = self.finished = True
        with trio.move_on_after(self.chunk_timeout_s):
            try:
                await self.raw.reset()
            except (BaseLibp2pError, OSError):
                pass  # reset is best effort: the connection may already be torn down


def _expects_error(expect: type[Message] | tuple[type[Message], ...]) -> bool:
    return ErrorReply in (expect if isinstance(expect, tuple) else (expect,))

