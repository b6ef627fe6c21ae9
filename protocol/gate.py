"""The gate in front of every inbound connection and stream: bans, stream limits, and the record.

A sans-IO core: :class:`Gate` decides whether a peer's connection or stream may in, and keeps the
record of every rejection (a counter by kind and the most recent ones in full, both bounded). The
libp2p adapter (:mod:`protolearn.protocol.transport`) asks it before reading a single byte, does the
resetting and closing, and reports every other rejection (bad frames, timeouts) here as well, so the
log line ``rejected peer=<id> protocol=<name> reason=<reason>`` is written in one place.

Per-peer limits (issue 12). A protocol's inbound streams are capped in total *and* per peer
(:meth:`Gate.admit_stream`, :meth:`Gate.release_stream` keep the counts), so a few identities
holding idle streams can no longer take every slot from honest peers. A protocol may also say which
peers it knows (a stage's members): the others, however many identities they use, share a part of the
slots (``outsider_limit``). Rejections of the kinds in
:data:`ABUSE_KINDS` (over a stream limit, over a per-peer buffer limit, too slow or idle past a
deadline) are abuse: :class:`Abuse` counts them per peer in a sliding window, and a peer with
``threshold`` of them within ``window_s`` is banned for ``ban_s`` seconds. A temporary ban expires
on its own (it is checked against ``now``, nothing has to lift it), and a peer that comes back and
abuses again is banned again. Every table is bounded: at most ``max_peers`` peers are counted and
temporarily banned at once, the oldest forgotten first. ``on_ban`` (the adapter's disconnect) is
told of each new ban.

Every rejection is counted, but not every one is written: a peer's first rejection in an interval
is written in full at once, and the rest of that interval's go into one summary line with their
count, their counts by kind and the last reason (:mod:`protolearn.protocol.log_digest`)::

    rejected peer=<id>: 249 more in 9.9 s (ProtocolError 200, TooLarge 49); the last: protocol=<name> reason=<reason>

so a garbage barrage costs two lines per peer and interval, not one per request. The adapter passes
``now`` and calls :meth:`Gate.flush_log` when :meth:`Gate.next_log_due` says.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from protolearn.protocol.log_digest import DEFAULT_INTERVAL_S, DEFAULT_MAX_PEERS, LogDigest, Summary

# Recent rejections kept in full (bounded: a hostile peer can cause unlimited rejections).
RECENT_REJECTIONS = 256
# Kinds the gate itself decides; the adapter adds the ProtocolError class names and "handler_error".
BANNED = "banned"
STREAM_LIMIT = "stream_limit"
# A peer declined the bulk lane for its own limits: it sends in-stream instead, so this costs it only
# speed and is not abuse (an honest upstream may well have more large activations in flight).
BULK_LIMIT = "bulk_limit"
# The kind a per-peer buffer limit (protocol/errors.py OverLimit) is recorded under.
OVER_LIMIT = "OverLimit"
# Rejections that count towards a temporary ban: a peer hogging slots or buffers, or holding a stream
# without sending (an idle or trickling stream ends in PeerTimeout). Malformed input does not count:
# it costs the host little and is already refused on the spot.
ABUSE_KINDS = frozenset({STREAM_LIMIT, OVER_LIMIT, "PeerTimeout"})
# Defaults of the temporary ban (TransportConfig carries them; see the module docstring).
DEFAULT_ABUSE_WINDOW_S = 60.0
DEFAULT_ABUSE_THRESHOLD = 50
DEFAULT_TEMP_BAN_S = 300.0
DEFAULT_MAX_TRACKED = 4096
OUTSIDERS = "(outsiders)"  # the key under which outsiders' streams are counted together (never a peer id)

log = logging.getLogger("protolearn.protocol")


@dataclass(frozen=True)
class Rejection:
    peer: str
    protocol: str
    kind: str
    reason: str


class Abuse:
    """Counts each peer's abuse rejections in a sliding window and hands out temporary bans.

    :meth:`note` returns the ban's reason when this rejection crossed the threshold (else None);
    :meth:`banned` is the reason of a ban still running at ``now``. Per peer at most ``threshold``
    times are kept, and at most ``max_peers`` peers in each table (the oldest forgotten first).
    """

    def __init__(
        self,
        *,
        window_s: float = DEFAULT_ABUSE_WINDOW_S,
        threshold: int = DEFAULT_ABUSE_THRESHOLD,
        ban_s: float = DEFAULT_TEMP_BAN_S,
        max_peers: int = DEFAULT_MAX_TRACKED,
    ) -> None:
        if window_s <= 0 or threshold <= 0 or ban_s <= 0 or max_peers <= 0:
            raise ValueError(f"abuse window {window_s}, threshold {threshold}, ban {ban_s} and max peers {max_peers} must be positive")
        self.window_s = window_s
        self.threshold = threshold
        self.ban_s = ban_s
        self.max_peers = max_peers
        self._times: OrderedDict[str, deque[float]] = OrderedDict()
        self._bans: OrderedDict[str, tuple[float, str]] = OrderedDict()  # peer -> (until, reason)
        self.num_bans = 0  # temporary bans handed out, ever

    def note(self, peer: str, kind: str, now: float) -> str | None:
        if self.banned(peer, now) is not None:
            return None  # already banned: its refused streams do not extend the ban
        times = self._times.pop(peer, None)
        if times is None:
            times = deque(maxlen=self.threshold)
        self._times[peer] = times  # most recently active last
        if len(self._times) > self.max_peers:
            self._times.popitem(last=False)
        times.append(now)
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) < self.threshold:
            return None
        del self._times[peer]
        reason = f"temporarily banned for {self.ban_s:g} s: {self.threshold} limit rejections within {self.window_s:g} s, the last {kind}"
        self._bans.pop(peer, None)
        self._bans[peer] = (now + self.ban_s, reason)
        if len(self._bans) > self.max_peers:
            self._bans.popitem(last=False)
        self.num_bans += 1
        return reason

    def banned(self, peer: str, now: float) -> str | None:
        entry = self._bans.get(peer)
        if entry is None:
            return None
        until, reason = entry
        if now >= until:
            del self._bans[peer]  # expired on its own
            return None
        return reason


class Gate:
    """Bans and rejection accounting. ``rejected`` counts by kind; ``recent`` keeps the last ones.

    ``bans`` are the permanent bans (:meth:`ban`); temporary ones live in ``abuse``. ``on_ban`` is
    called with the peer of each new temporary ban (the adapter closes its connection).
    """

    def __init__(
        self,
        *,
        num_recent: int = RECENT_REJECTIONS,
        log_interval_s: float = DEFAULT_INTERVAL_S,
        log_max_peers: int = DEFAULT_MAX_PEERS,
        abuse: Abuse | None = None,
        on_ban: Callable[[str], None] | None = None,
    ) -> None:
        self.bans: dict[str, str] = {}
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Rejection] = deque(maxlen=num_recent)
        self.abuse = Abuse() if abuse is None else abuse
        self.on_ban = on_ban
        self._log: LogDigest[Rejection] = LogDigest(interval_s=log_interval_s, max_peers=log_max_peers)
        self._active: Counter[str] = Counter()  # protocol -> inbound streams being handled
        self._active_peer: Counter[tuple[str, str]] = Counter()  # (protocol, peer) -> the same, per peer
        self._outsider_streams: Counter[tuple[str, str]] = Counter()  # (protocol, peer) -> its streams admitted as an outsider

    def ban(self, peer: str, reason: str) -> None:
        self.bans[peer] = reason
        log.warning("banned peer=%s reason=%s", peer, reason)

    def unban(self, peer: str) -> None:
        if self.bans.pop(peer, None) is not None:
            log.info("unbanned peer=%s", peer)

    def ban_reason(self, peer: str, now: float) -> str | None:
        """Why ``peer`` is banned at ``now`` (permanently or for a while), or None."""
        reason = self.bans.get(peer)
        return reason if reason is not None else self.abuse.banned(peer, now)

    def is_banned(self, peer: str, now: float | None = None) -> bool:
        """Banned at ``now``; without ``now``, only permanent bans are looked at."""
        return peer in self.bans or (now is not None and self.abuse.banned(peer, now) is not None)

    def check_connection(self, peer: str, now: float | None = None) -> Rejection | None:
        """The rejection of a new connection from ``peer``, or None to let it stay."""
        reason = self.bans.get(peer) if now is None else self.ban_reason(peer, now)
        if reason is not None:
            return Rejection(peer, "connection", BANNED, f"banned: {reason}")
        return None

    def check_stream(
        self, peer: str, protocol: str, *, num_active: int, limit: int, num_active_peer: int = 0, peer_limit: int | None = None,
        now: float | None = None,
    ) -> Rejection | None:
        """The rejection of a new inbound stream, or None to admit it. Over a limit is refused, never queued."""
        reason = self.bans.get(peer) if now is None else self.ban_reason(peer, now)
        if reason is not None:
            return Rejection(peer, protocol, BANNED, f"banned: {reason}")
        if peer_limit is not None and num_active_peer >= peer_limit:
            return Rejection(peer, protocol, STREAM_LIMIT, f"peer over its limit of {peer_limit} concurrent inbound streams")
        if num_active >= limit:
            return Rejection(peer, protocol, STREAM_LIMIT, f"over the limit of {limit} concurrent inbound streams")
        return None

    def admit_stream(
        self, peer: str, protocol: str, *, limit: int, peer_limit: int, now: float, outsider: bool = False,
        outsider_limit: int | None = None,
    ) -> Rejection | None:
        """Count a new inbound stream in, or return (and record) why it is refused.

        ``outsider``: the protocol's owner does not know ``peer`` (e.g. not a member of its stage);
        outsiders together get at most ``outsider_limit`` of the slots, so that many Sybil identities,
        each within its own limit, still cannot take the slots the known peers need.
        An admitted stream must be let go with :meth:`release_stream` when its handler is done.
        """
        rejection = self.check_stream(
            peer, protocol, num_active=self._active[protocol], limit=limit,
            num_active_peer=self._active_peer[(protocol, peer)], peer_limit=peer_limit, now=now,
        )
        key = (protocol, OUTSIDERS)
        if rejection is None and outsider and outsider_limit is not None and self._active_peer[key] >= outsider_limit:
            rejection = Rejection(peer, protocol, STREAM_LIMIT, f"unknown peers hold their limit of {outsider_limit} concurrent inbound streams")
        if rejection is not None:
            self.record(rejection, now)
            return rejection
        self._active[protocol] += 1
        self._active_peer[(protocol, peer)] += 1
        if outsider:
            self._active_peer[key] += 1
            self._outsider_streams[(protocol, peer)] += 1
        return None

    def release_stream(self, peer: str, protocol: str) -> None:
        if self._outsider_streams.get((protocol, peer), 0) > 0:
            self._outsider_streams[(protocol, peer)] -= 1
            if not self._outsider_streams[(protocol, peer)]:
                del self._outsider_streams[(protocol, peer)]
            self._active_peer[(protocol, OUTSIDERS)] -= 1
        self._active[protocol] -= 1
        key = (protocol, peer)
        self._active_peer[key] -= 1
        if self._active_peer[key] <= 0:
            del self._active_peer[key]  # the table holds only peers with streams open

    def active_streams(self, protocol: str, peer: str | None = None) -> int:
        """Inbound streams of ``protocol`` being handled now (those of ``peer`` only, if given)."""
        return self._active[protocol] if peer is None else self._active_peer.get((protocol, peer), 0)

    def record(self, rejection: Rejection, now: float) -> None:
        """Count ``rejection``; write it now if it is its peer's first in the interval (see module doc).

        An abuse rejection that crosses the threshold bans its peer for a while (see module doc).
        """
        self.rejected[rejection.kind] += 1
        self.recent.append(rejection)
        write, due = self._log.note(rejection.peer, rejection.kind, rejection, now)
        _write_summaries(due)
        if write:
            log.warning("rejected peer=%s protocol=%s reason=%s", rejection.peer, rejection.protocol, rejection.reason)
        if rejection.kind in ABUSE_KINDS:
            reason = self.abuse.note(rejection.peer, rejection.kind, now)
            if reason is not None:
                log.warning("banned peer=%s reason=%s", rejection.peer, reason)
                if self.on_ban is not None:
                    self.on_ban(rejection.peer)

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
