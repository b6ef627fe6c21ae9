"""The gate in front of every inbound connection and stream: bans, stream limits, and the record.

A sans-IO core: :class:`Gate` decides whether a peer's connection or stream may in, and keeps the
record of every rejection (a counter by kind and the most recent ones in full, both bounded). The
libp2p adapter (:mod:`protolearn.protocol.transport`) asks it before reading a single byte, does the
resetting and closing, and reports every other rejection (bad frames, timeouts) here as well, so the
log line ``rejected peer=<id> protocol=<name> reason=<reason>`` is written in one place.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

# Recent rejections kept in full (bounded: a hostile peer can cause unlimited rejections).
RECENT_REJECTIONS = 256
# Kinds the gate itself decides; the adapter adds the ProtocolError class names and "handler_error".
BANNED = "banned"
STREAM_LIMIT = "stream_limit"

log = logging.getLogger("protolearn.protocol")


@dataclass(frozen=True)
class Rejection:
    peer: str
    protocol: str
    kind: str
    reason: str


class Gate:
    """Bans and rejection accounting. ``rejected`` counts by kind; ``recent`` keeps the last ones."""

    def __init__(self, *, num_recent: int = RECENT_REJECTIONS) -> None:
        self.bans: dict[str, str] = {}
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Rejection] = deque(maxlen=num_recent)

    def ban(self, peer: str, reason: str) -> None:
        self.bans[peer] = reason
        log.warning("banned peer=%s reason=%s", peer, reason)

    def unban(self, peer: str) -> None:
        if self.bans.pop(peer, None) is not None:
            log.info("unbanned peer=%s", peer)

    def is_banned(self, peer: str) -> bool:
        return peer in self.bans

    def check_connection(self, peer: str) -> Rejection | None:
        """The rejection of a new connection from ``peer``, or None to let it stay."""
        if peer in self.bans:
            return Rejection(peer, "connection", BANNED, f"banned: {self.bans[peer]}")
        return None

    def check_stream(self, peer: str, protocol: str, *, num_active: int, limit: int) -> Rejection | None:
        """The rejection of a new inbound stream, or None to admit it. Over the limit is refused, never queued."""
        if peer in self.bans:
            return Rejection(peer, protocol, BANNED, f"banned: {self.bans[peer]}")
        if num_active >= limit:
            return Rejection(peer, protocol, STREAM_LIMIT, f"over the limit of {limit} concurrent inbound streams")
        return None

    def record(self, rejection: Rejection) -> None:
        self.rejected[rejection.kind] += 1
        self.recent.append(rejection)
        log.warning("rejected peer=%s protocol=%s reason=%s", rejection.peer, rejection.protocol, rejection.reason)

    def reject(self, peer: str, protocol: str, kind: str, reason: str) -> None:
        self.record(Rejection(peer, protocol, kind, reason))
