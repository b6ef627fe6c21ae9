"""Per-peer log digests: a peer that makes us refuse it a thousand times costs a few log lines, not a thousand.

A hostile peer can make a host reject its requests as fast as it can send them. Writing one warning
per rejection turns that into a disk-filling amplifier (a 40 s garbage barrage from one peer once
wrote 3,115 lines). :class:`LogDigest` decides, per peer and interval, what is worth a line:

- the first event of a peer in an interval is written at once, in full (nothing is hidden from the
  operator, and an honest peer's one-off problem still reads as before);
- the peer's further events in that interval are only counted, by kind, keeping the last one;
- when the interval ends, one summary gives their count, the counts by kind and the last event.

So a peer costs at most two lines per interval, whatever it sends. Memory is bounded too: at most
``max_peers`` peers are tracked at once, and the events of any further peer share one overflow
entry (itself at most two lines per interval); each entry keeps at most :data:`MAX_KINDS` kind
counters. The total number of events is never lost: first lines count one each, summaries count
``num_more`` each.

Sans-IO: every call takes ``now`` (any monotonic clock, in seconds). The caller writes the lines:
:meth:`LogDigest.note` says whether to write this event now and returns the summaries that fell due,
and the adapter calls :meth:`LogDigest.flush` at :meth:`LogDigest.next_due` (and with
``everything=True`` when it shuts down), so a summary comes out even when the peer has gone quiet.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# A peer's events are summarised once per interval (seconds).
DEFAULT_INTERVAL_S = 10.0
# Peers tracked at once; events of further peers share one overflow entry.
DEFAULT_MAX_PEERS = 1024
# Kind counters per entry; further kinds are counted under OTHER_KIND.
MAX_KINDS = 16
OTHER_KIND = "other"

T = TypeVar("T")


@dataclass(frozen=True)
class Summary(Generic[T]):
    """What a peer did in one interval after the event that was written in full."""

    peer: str | None  # None: the peers beyond ``max_peers``, together
    num_more: int  # events counted, not written, after the first
    kinds: tuple[tuple[str, int], ...]  # their counts by kind, most frequent first
    last: T  # the last of them
    last_peer: str  # who sent the last one (differs from ``peer`` only for the overflow entry)
    span_s: float  # from the written event to the last counted one

    def head(self) -> str:
        """``peer=<id>: 249 more in 9.9 s (TooLarge 200, ProtocolError 49); the last:``, for the caller
        to append the last event's fields to (the overflow entry adds ``peer=<who sent it>``)."""
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.kinds)
        who = self.peer if self.peer is not None else "(peers beyond the tracked ones)"
        last_peer = "" if self.peer is not None else f" peer={self.last_peer}"
        return f"peer={who}: {self.num_more} more in {self.span_s:.1f} s ({kinds}); the last:{last_peer}"


@dataclass
class _Entry(Generic[T]):
    start: float
    last_at: float
    last_peer: str
    last: T | None = None
    num_more: int = 0
    kinds: Counter[str] = field(default_factory=Counter)

    def count(self, peer: str, kind: str, item: T, now: float) -> None:
        self.num_more += 1
        if kind not in self.kinds and len(self.kinds) >= MAX_KINDS:
            kind = OTHER_KIND
        self.kinds[kind] += 1
        self.last, self.last_peer, self.last_at = item, peer, now

    def summary(self, peer: str | None) -> Summary[T] | None:
        if not self.num_more:
            return None
        assert self.last is not None  # set by every count()
        return Summary(peer, self.num_more, tuple(self.kinds.most_common()), self.last, self.last_peer, self.last_at - self.start)


class LogDigest(Generic[T]):
    """Which per-peer events to write now, and the per-interval summaries of the rest (see module doc)."""

    def __init__(self, *, interval_s: float = DEFAULT_INTERVAL_S, max_peers: int = DEFAULT_MAX_PEERS) -> None:
        if interval_s <= 0 or max_peers <= 0:
            raise ValueError(f"interval_s and max_peers must be positive, got {interval_s} and {max_peers}")
        self.interval_s = interval_s
        self.max_peers = max_peers
        # In order of their interval's start (``now`` never decreases), so the first entry ends first.
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._overflow: _Entry[T] | None = None

    def __len__(self) -> int:
        """Peers tracked now (the overflow entry not included)."""
        return len(self._entries)

    def note(self, peer: str, kind: str, item: T, now: float) -> tuple[bool, list[Summary[T]]]:
        """Account for one event of ``peer``: (write it in full now?, summaries that fell due)."""
        due = self.flush(now)
        entry = self._entries.get(peer)
        if entry is None:
            if len(self._entries) < self.max_peers:
                self._entries[peer] = _Entry(start=now, last_at=now, last_peer=peer)
                return True, due
            if self._overflow is None:
                self._overflow = _Entry(start=now, last_at=now, last_peer=peer)
                return True, due
            entry = self._overflow
        entry.count(peer, kind, item, now)
        return False, due

    def flush(self, now: float, *, everything: bool = False) -> list[Summary[T]]:
        """End the intervals that are over at ``now`` (all of them with ``everything``); their summaries."""
        out: list[Summary[T]] = []
        while self._entries:
            peer, entry = next(iter(self._entries.items()))
            if not everything and now < entry.start + self.interval_s:
                break
            del self._entries[peer]
            summary = entry.summary(peer)
            if summary is not None:
                out.append(summary)
        if self._overflow is not None and (everything or now >= self._overflow.start + self.interval_s):
            summary = self._overflow.summary(None)
            self._overflow = None
            if summary is not None:
                out.append(summary)
        return out

    def next_due(self) -> float | None:
        """When the next interval ends (None: nothing is tracked). O(1)."""
        ends = [e.start + self.interval_s for e in (next(iter(self._entries.values()), None), self._overflow) if e is not None]
        return min(ends) if ends else None
