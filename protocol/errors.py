"""Errors of the wire protocol. Every rejection names the peer and the reason."""

from __future__ import annotations

from protolearn.errors import ProtolearnError


class ProtocolError(ProtolearnError):
    """Bytes from a peer broke the protocol: bad framing, schema, size, version or tensor.

    ``peer`` is the remote peer ID (or ``"local"`` when encoding); ``reason`` is a short, stable
    explanation that goes into the log line.
    """

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer}: {reason}")
        self.peer = peer
        self.reason = reason


class TooLarge(ProtocolError):
    """A declared or actual size exceeds a configured limit (checked before allocating)."""


class PeerTimeout(ProtocolError):
    """A peer did not answer or send within the deadline."""


class PeerUnavailable(ProtocolError):
    """A peer could not be dialled, or its stream broke (reset, EOF mid-message, refused)."""


class WrongPeer(PeerUnavailable):
    """The address answered, but the Noise handshake showed another peer's key: a retry cannot help."""


class Refused(ProtocolError):
    """The remote side refused a request (banned, over its stream limit, or an application error)."""


class SignatureError(ProtocolError):
    """A signature does not verify against the claimed key."""


class OverLimit(ProtocolError):
    """A peer went over one of its per-peer limits (streams, buffered bytes, bulk-lane transfers).

    Its own limit only: other peers are not affected. Repeated, it leads to a temporary ban (see
    :mod:`protolearn.protocol.gate`).
    """
