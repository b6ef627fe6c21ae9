"""What the two ends of a bulk-lane transfer agree on over the libp2p stream, and the receiver's
bounded table of pending offers.

The negotiation of :mod:`.bulk` in messages: the receiver answers a tensor header that asks for the lane
with a :class:`BulkOffer` (its lane's port, a fresh token and key; the stream is Noise-encrypted, so
only the authenticated peer learns them) or a :class:`BulkDecline`, and the sender says which way the
bytes come (:class:`BulkChoice`). :class:`OfferTable` is the receiver's sans-IO bookkeeping of its
offers: bounded in number and in the receive buffers they reserve, in total and per peer, and each one
expires unless its connection presents the token in time.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import ClassVar

from protolearn.protocol.transport.seal import KEY_BYTES, TOKEN_BYTES
from protolearn.protocol.wire import Message


class BulkOffer(Message):
    """Receiver to sender: send the payload to ``port`` on my IP, presenting ``token``, sealed with ``key``."""

    KIND: ClassVar[str] = "bulk_offer"
    port: int
    token: bytes
    key: bytes


class BulkDecline(Message):
    """Receiver to sender: no lane now (disabled, too many pending offers); send in-stream."""

    KIND: ClassVar[str] = "bulk_decline"
    reason: str


class BulkChoice(Message):
    """Sender to receiver, after an offer: whether the payload comes over the lane or the stream."""

    KIND: ClassVar[str] = "bulk_choice"
    lane: bool
    reason: str = ""


@dataclass
class Offer:
    token: bytes
    key: bytes
    peer: str
    num_bytes: int
    expires_at: float


class OfferTable:
    """Pending offers and the receive buffers they reserve, both bounded; an unclaimed offer expires.

    ``create`` returns an :class:`Offer` or the reason for refusing one; ``claim`` hands an offer to
    the connection that presents its token (once, before it expires); ``release`` ends an offer,
    claimed or not, and frees its reservation. A lane buffer is allocated whole when its connection
    arrives, not as bytes come in, so the bytes reserved by all offers are capped (``max_bytes``):
    past the cap, senders are declined and use the stream, which only holds what arrived.
    """

    def __init__(
        self, *, max_pending: int, max_bytes: int, ttl_s: float, max_pending_per_peer: int | None = None,
        max_bytes_per_peer: int | None = None,
    ) -> None:
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self.max_pending_per_peer = max_pending if max_pending_per_peer is None else max_pending_per_peer
        self.max_bytes_per_peer = max_bytes if max_bytes_per_peer is None else max_bytes_per_peer
        self.ttl_s = ttl_s
        self.reserved_bytes = 0
        self._peer_pending: dict[str, int] = {}  # only peers with offers, so bounded by max_pending
        self._peer_bytes: dict[str, int] = {}
        self._offers: dict[bytes, Offer] = {}  # made, not yet claimed
        self._claimed: dict[bytes, Offer] = {}  # claimed, transfer not yet over

    def __len__(self) -> int:
        return len(self._offers) + len(self._claimed)

    def over_peer_limit(self, peer: str, num_bytes: int, now: float) -> str | None:
        """Why ``peer`` may not have one more offer of ``num_bytes`` (its own limits), or None."""
        self.expire(now)
        pending, reserved = self._peer_pending.get(peer, 0), self._peer_bytes.get(peer, 0)
        if pending >= self.max_pending_per_peer:
            return f"peer has {pending} bulk transfers pending, its limit is {self.max_pending_per_peer}"
        if reserved + num_bytes > self.max_bytes_per_peer:
            return f"peer has {reserved} bulk bytes reserved, {num_bytes} more exceed its limit of {self.max_bytes_per_peer}"
        return None

    def create(self, peer: str, num_bytes: int, now: float) -> Offer | str:
        self.expire(now)
        if len(self) >= self.max_pending:
            return f"{len(self)} bulk transfers pending, the limit is {self.max_pending}"
        if self.reserved_bytes + num_bytes > self.max_bytes:
            return f"bulk buffers of {self.reserved_bytes} bytes reserved, {num_bytes} more exceed the limit of {self.max_bytes}"
        over = self.over_peer_limit(peer, num_bytes, now)
        if over is not None:
            return over
        offer = Offer(secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(KEY_BYTES), peer, num_bytes, now + self.ttl_s)
        self._offers[offer.token] = offer
        self.reserved_bytes += num_bytes
        self._peer_pending[peer] = self._peer_pending.get(peer, 0) + 1
        self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + num_bytes
        return offer

    def claim(self, token: bytes, now: float) -> tuple[Offer | None, str]:
        self.expire(now)
        offer = self._offers.pop(token, None)
        if offer is None:
            return None, "token is not a pending offer"
        self._claimed[token] = offer
        return offer, ""

    def release(self, token: bytes) -> None:
        offer = self._offers.pop(token, None) or self._claimed.pop(token, None)
        if offer is not None:
            self.reserved_bytes -= offer.num_bytes
            left = self._peer_pending[offer.peer] - 1
            if left:
                self._peer_pending[offer.peer] = left
                self._peer_bytes[offer.peer] -= offer.num_bytes
            else:
                del self._peer_pending[offer.peer], self._peer_bytes[offer.peer]

    def expire(self, now: float) -> list[Offer]:
        gone = [o for o in self._offers.values() if o.expires_at <= now]
        for o in gone:
            self.release(o.token)
        return gone


__all__ = ["BulkChoice", "BulkDecline", "BulkOffer", "Offer", "OfferTable"]
