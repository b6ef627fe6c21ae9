"""Serving inbound streams: the gate before a byte is read, per-protocol limits, and handlers that
cannot take the host down.

Every inbound stream of a protocol this host serves passes the gate first (:meth:`Server.serve_raw`):
a banned peer's stream is reset, and so is one over the protocol's limit of concurrent inbound streams,
in total or from that peer, or from peers a ``known`` check says no to (they share a smaller limit, so
Sybils cannot crowd known peers out). Then :meth:`Server.serve` reads one request within its byte
limit and the base deadline, and answers it: a handler's :class:`~protolearn.errors.ProtolearnError`
becomes an :class:`~protolearn.protocol.wire.ErrorReply`, a request that fails to decode gets one
naming the reason; a request its caller abandons before its first byte, or a reply it went away before, is
logged at info and not counted as a rejection. :meth:`Server.serve_stream` hands the framed stream to its handler instead. The one
broad catch of the transport is here: a handler's failure is logged with the peer, the protocol and
the reason, the stream is reset, and the host keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream

from protolearn.errors import ProtolearnError
from protolearn.protocol.errors import PeerUnavailable, ProtocolError
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.gatekeeper import Gatekeeper
from protolearn.protocol.transport.libp2p_errors import reset_quietly
from protolearn.protocol.transport.names import protocol_id
from protolearn.protocol.transport.streams import FramedStream
from protolearn.protocol.wire import ErrorReply, Message

log = logging.getLogger("protolearn.protocol")

RequestHandler = Callable[[str, Message], Awaitable[Message]]
StreamHandler = Callable[[str, FramedStream], Awaitable[None]]
RawHandler = Callable[[str, INetStream], Awaitable[None]]
# Frames a raw stream of (raw stream, peer, protocol name) under the host's deadlines and limits.
Wrap = Callable[[INetStream, str, str], FramedStream]


class Server:
    """The protocols host ``lp`` serves, behind ``keeper``'s gate; ``wrap`` frames each accepted stream."""

    def __init__(self, lp: IHost, config: TransportConfig, keeper: Gatekeeper, wrap: Wrap) -> None:
        self._lp = lp
        self.config = config
        self._keeper = keeper
        self._wrap = wrap
        self.requests_served = 0  # requests answered with a normal (non-error) reply

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
        gate, clock = self._keeper.gate, self._keeper.clock

        async def on_stream(peer: str, s: FramedStream) -> None:
            s.max_message_bytes = request_limit
            try:
                # An honest caller writes its request at once: an idle stream is let go after the base deadline.
                request = await s.receive(request_type, timeout=min(self.config.request_timeout_s, self.config.message_deadline_s))
            except PeerUnavailable as err:
                if not s.bytes_received:
                    # It closed the stream before a byte of its request: a caller that gave up (e.g. a lease
                    # request cancelled when its step closed), normal operation, not a bad request.
                    log.info("request abandoned peer=%s protocol=%s reason=%s", peer, name, err.reason)
                    await s.reset()
                    return
                gate.reject(peer, name, type(err).__name__, err.reason, clock())
                await self._refuse(s, err)
                return
            except ProtocolError as err:
                gate.reject(peer, name, type(err).__name__, err.reason, clock())
                await self._refuse(s, err)
                return
            try:
                reply = await handler(peer, request)
            except ProtocolError as err:
                gate.reject(peer, name, type(err).__name__, err.reason, clock())
                reply = ErrorReply(code=type(err).__name__, reason=err.reason)
            except ProtolearnError as err:
                self._keeper.log_refusal(peer, name, type(err).__name__, str(err))
                reply = ErrorReply(code=type(err).__name__, reason=str(err))
            try:
                await s.send(reply, timeout=self.config.request_timeout_s)
            except PeerUnavailable as err:
                # The caller went away before its reply (it was cancelled, or died): nothing to refuse.
                log.info("reply undelivered peer=%s protocol=%s reason=%s", peer, name, err.reason)
                await s.reset()
                return
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
        self, pid: str, name: str, handler: RawHandler, *, max_inbound: int | None = None,
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
        keeper = self._keeper

        async def on_raw_stream(raw: INetStream) -> None:
            peer = str(raw.muxed_conn.peer_id)
            outsider = known is not None and not known(peer)
            rejection = keeper.gate.admit_stream(
                peer, name, limit=limit, peer_limit=peer_limit, now=keeper.clock(), outsider=outsider, outsider_limit=max_inbound_unknown,
            )
            if rejection is not None:
                await reset_quietly(raw, self.config.chunk_timeout_s)
                if keeper.ban_reason(peer) is not None:
                    keeper.schedule_disconnect(peer)
                return
            try:
                await handler(peer, raw)
            finally:
                keeper.gate.release_stream(peer, name)

        self._lp.set_stream_handler(pid, on_raw_stream)  # type: ignore[arg-type]

    async def _run_handler(self, handler: StreamHandler, peer: str, name: str, s: FramedStream) -> None:
        # The one broad catch: a handler failure must never take the host down.
        gate, clock = self._keeper.gate, self._keeper.clock
        try:
            await handler(peer, s)
        except ProtocolError as err:
            gate.reject(peer, name, type(err).__name__, err.reason, clock())
            await s.reset()
            return
        except Exception as err:
            gate.reject(peer, name, "handler_error", f"handler failed: {type(err).__name__}: {err}", clock())
            log.exception("handler failed peer=%s protocol=%s", peer, name)
            await s.reset()
            return
        await s.close()


__all__ = ["RawHandler", "RequestHandler", "Server", "StreamHandler"]
