"""The gate in front of every inbound connection and stream: bans, stream limits, and the record.

A sans-IO core: :class:`Gate` decides whether a peer's connection or stream may in, and keeps the
record of every rejection (a counter by kind and the most recent ones in full, both bounded). The
libp2p adapter (:mod:`protolearn.protocol.transport`) asks it before reading a single byte, does the
resetting and closing, and reports every other rejection (bad frames, timeouts) here as well, so the
log line ``rejected peer=<id> protocol=<name> reason=<reason>`` is written in one place.

Every rejection is counted, but not every one is written: a peer's first rejection in an interval
is written in full at once, and the rest of that interval's go into one summary line with their
count, their counts by kind and the last reason (:mod:`protolearn.protocol.log_digest`)::

    rejected peer=<id>: 249 more in 9.9 s (ProtocolError 200, TooLarge 49); the last: protocol=<name> reason=<reason>

so a garbage barrage costs two lines per peer and interval, not one per request. The adapter passes
``now`` and calls :meth:`Gate.flush_log` when :meth:`Gate.next_log_due` says.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from protolearn.protocol.log_digest import DEFAULT_INTERVAL_S, DEFAULT_MAX_PEERS, LogDigest, Summary

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

    def __init__(
        self,
        *,
        num_recent: int = RECENT_REJECTIONS,
        log_interval_s: float = DEFAULT_INTERVAL_S,
        log_max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        self.bans: dict[str, str] = {}
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Rejection] = deque(maxlen=num_recent)
        self._log: LogDigest[Rejection] = LogDigest(interval_s=log_interval_s, max_peers=log_max_peers)

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

    def record(self, rejection: Rejection, now: float) -> None:
        """Count ``rejection``; write it now if it is its peer's first in the interval (see module doc)."""
        self.rejected[rejection.kind] += 1
        self.recent.append(rejection)
        write, due = self._log.note(rejection.peer, rejection.kind, rejection, now)
        _write_summaries(due)
        if write:
            log.warning("rejected peer=%s protocol=%s reason=%s", rejection.peer, rejection.protocol, rejection.reason)

    def reject(self, peer: str, protocol: str, kind: str, reason: str, now: float) -> None:
        self.record(Rejection(peer, protocol, kind, reason), now)

    def flush_log(self, now: float, *, everything: bool = False) -> None:
        """Write the summaries of the intervals over at ``now`` (all of them with ``everything``)."""
        _write_summaries(self._log.flush(now, everything=everything))

    def next_log_due(self) -> float | None:
        """When :meth:`flush_log` next has an interval to end (None: no peer is being counted)."""
        return self._log.next_due()


def _write_summaries(summaries: list[Summary[Rejection]]) -> None:
    for s in summaries:
        log.warning("rejected %s protocol=%s reason=%s", s.head(), s.last.protocol, s.last.reason)
