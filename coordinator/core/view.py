"""The membership view: what each node is told about the other members, bounded and incremental.

**Versions.** Every change other nodes must see (a join, leave, expiry, ban or move, a state change
into or out of serving) takes the next version number. The view keeps, per stage, the version that
last changed it, and a log of the last :data:`LOG_LEN` changes. A node sends the version it holds,
and gets one of:

- nothing, when none of the stages it is told about changed since then: an O(1) check whatever the
  size of the swarm, and the common case of a heartbeat;
- a *snapshot*, the default, which node code applies by replacing its list: every stage, bounded
  (below). Node code reads all of them: stage 0 notices a departure on any of its routes by
  comparing successive views, and every node shows which stages have no replica;
- a *delta*, when it asks for one (``Heartbeat.view_delta``), of its *neighbourhood* only: a node of
  stage ``s`` sends activations to ``s+1``, averages with and syncs from ``s``, and sends gradients
  back to ``s-1`` (while it moves, the stages around its old and new stage). The reply carries the
  neighbourhood members that changed since its version (``members``, to upsert) and the peers to
  drop (``removed``, applied first): every member that stopped being live *anywhere* (stage 0
  restarts the tickets it routed through a departed member, whatever its stage), and those that moved
  out of the neighbourhood. Its size follows the churn since the node's last beat, not the swarm's
  size. When nothing concerns the node but the version moved on, an empty delta moves it to the
  current version, so that it stays within the log. A version older than the log, from another
  coordinator run, or held for another neighbourhood (the node moved) gets a snapshot (of the
  neighbourhood) instead.

**Bounds.** A snapshot holds at most :data:`VIEW_PER_STAGE` members of a stage and :data:`VIEW_MAX`
in all, so a join reply stays far below the frame cap however large the swarm (``VIEW_MAX`` entries of
at most ~0.7 KiB each, with the longest peer ID and 4 of the longest addresses: ~0.7 MiB against the
16 MiB cap, measured at 100,000 members in tests/unit/test_attacks_registry.py). Serving members
(training or averaging) come first, so a stage with a live replica never looks empty. Of a larger
stage each node sees a window that starts at a place derived from its own peer ID, so that nodes
spread over the stage's replicas rather than all routing to the same few. A delta is bounded by
``LOG_LEN`` changes, and one that would upsert more than ``VIEW_MAX`` members is sent as a
snapshot instead, so no view reply ever carries more than ``VIEW_MAX`` entries.

Versions start at a number derived from the coordinator's start time (:func:`first_version`), so a
node that still holds a version from before a coordinator restart is never mistaken for current.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from protolearn.coordinator.core.members import SERVING_STATES
from protolearn.protocol import coordination as cm
from protolearn.protocol.wire import record_size

# Most members of one stage in a snapshot, and in all (at most MAX_STAGES stages get one each).
VIEW_PER_STAGE = 256
VIEW_MAX = 1024
# The order of a delta's upserts (by peer ID alone: a key of (stage, peer ID) took half of a delta's time).
_BY_PEER = attrgetter("peer_id")
# Changes remembered for deltas; a node further behind gets a snapshot.
LOG_LEN = 4096
# Versions of one coordinator run start at (start time in ms) << this: no run makes 2**20 view
# changes per millisecond, so a later run's versions never meet an earlier run's.
_RUN_SHIFT = 20


def first_version(started_at: float) -> int:
    return int(max(0.0, started_at) * 1000) << _RUN_SHIFT


@dataclass(frozen=True)
class ViewUpdate:
    """What a reply carries about the view: a snapshot to replace the node's list, or a delta."""

    version: int
    members: list[cm.MemberView]
    removed: list[str] = field(default_factory=list)
    delta: bool = False


@dataclass(frozen=True)
class _Change:
    version: int
    peer_id: str
    # The stage it was in before this change (-1: it was not live), and whether it stopped being live.
    was_stage: int
    departed: bool
    # The stage it is in after this change (-1: it stopped being live).
    stage: int = -1


class SwarmView:
    """The live members' view entries by stage, with per-stage versions and a change log."""

    def __init__(self, num_stages: int, version: int = 0, entries: Iterable[cm.MemberView] = ()) -> None:
        self.num_stages = num_stages
        self.version = version
        self._first = version
        self._entries: dict[str, cm.MemberView] = {}
        # Each stage's live peers, serving ones and the others, in no particular order (a removal swaps
        # the last one in), and where each one is: (stage, serving, index).
        self._lists: list[tuple[list[str], list[str]]] = [([], []) for _ in range(num_stages)]
        self._where: dict[str, tuple[int, bool, int]] = {}
        self._stage_version = [version] * num_stages
        self._log: deque[_Change] = deque()
        # The same changes by the stages each touches (was_stage and stage), and the departures: a delta reads
        # those of its neighbourhood's stages and the departures, not every change since its version
        # (every change of the swarm at every heartbeat made the heartbeats' cost grow with the square of its size).
        self._stage_log: list[deque[_Change]] = [deque() for _ in range(num_stages)]
        self._departures: deque[_Change] = deque()
        # A delta from a version at or after this one is complete (older changes left the log).
        self._log_floor = version
        # The neighbourhood each member's view was last built for: another one needs a snapshot.
        self._basis: dict[str, tuple[int, ...]] = {}
        # The version of the last departure anywhere (every delta reports those).
        self._departed = version
        # Each live entry's encoded size, with the entry it is of (a join reply's size check adds them up).
        self._sizes: dict[str, tuple[cm.MemberView, int]] = {}
        for e in entries:  # the live members after a restart: no change to tell anyone about
            self._entries[e.peer_id] = e
            self._list(e)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer_id: str) -> cm.MemberView | None:
        return self._entries.get(peer_id)

    # -- changes --------------------------------------------------------------------------------

    def put(self, entry: cm.MemberView) -> None:
        """``entry.peer_id`` is live with this entry: it joined, or changed in a way others must see."""
        peer = entry.peer_id
        old = self._entries.get(peer)
        was = old.stage if old is not None else -1
        self.version += 1
        self._unlist(peer)
        self._list(entry)
        self._entries[peer] = entry
        self._record(_Change(self.version, peer, was, False, entry.stage), was, entry.stage)

    def drop(self, peer_id: str) -> None:
        """``peer_id`` stopped being live (left, expired, banned)."""
        old = self._entries.pop(peer_id, None)
        if old is None:
            return
        self.version += 1
        self._unlist(peer_id)
        self._basis.pop(peer_id, None)
        self._sizes.pop(peer_id, None)
        self._departed = self.version
        self._record(_Change(self.version, peer_id, old.stage, True), old.stage)

    def _list(self, entry: cm.MemberView) -> None:
        if 0 <= entry.stage < self.num_stages:
            serving = entry.state in SERVING_STATES  # snapshots list serving members first
            peers = self._lists[entry.stage][serving]
            self._where[entry.peer_id] = (entry.stage, serving, len(peers))
            peers.append(entry.peer_id)

    def _unlist(self, peer: str) -> None:
        where = self._where.pop(peer, None)
        if where is None:
            return
        stage, serving, i = where
        peers = self._lists[stage][serving]
        last = peers.pop()
        if last != peer:
            peers[i] = last
            self._where[last] = (stage, serving, i)

    def _record(self, change: _Change, *stages: int) -> None:
        for s in stages:
            if 0 <= s < self.num_stages:
                self._stage_version[s] = change.version
        self._log.append(change)
        for s in self._touched(change):
            self._stage_log[s].append(change)
        if change.departed:
            self._departures.append(change)
        if len(self._log) > LOG_LEN:
            old = self._log.popleft()
            self._log_floor = old.version
            for s in self._touched(old):  # the oldest change is the first of each index it is in
                self._stage_log[s].popleft()
            if old.departed:
                self._departures.popleft()

    def _touched(self, change: _Change) -> tuple[int, ...]:
        """The stages ``change`` is indexed under: the one it left and the one it is in (once each)."""
        n = self.num_stages
        was, now = change.was_stage, change.stage
        if 0 <= was < n:
            return (was,) if was == now or not 0 <= now < n else (was, now)
        return (now,) if 0 <= now < n else ()

    # -- what a node is told ----------------------------------------------------------------------

    def neighbourhood(self, *stages: int) -> tuple[int, ...]:
        """The stages next to and at each of ``stages`` (negative ones are ignored)."""
        near = {t for s in stages if s >= 0 for t in (s - 1, s, s + 1) if 0 <= t < self.num_stages}
        return tuple(sorted(near))

    def _current(self, version: int) -> bool:
        """Whether ``version`` is one this view handed out (not from another run, nor made up)."""
        return self._first <= version <= self.version

    def changed(self, stages: tuple[int, ...], version: int) -> bool:
        if not self._current(version):
            return True
        if len(stages) == self.num_stages:
            return self.version > version
        return any(self._stage_version[s] > version for s in stages)

    def snapshot(self, stages: Iterable[int], key: str) -> list[cm.MemberView]:
        """Up to ``VIEW_PER_STAGE`` members of each of ``stages`` and ``VIEW_MAX`` in all, each stage's
        window starting at a place derived from ``key`` (the asking node's peer ID)."""
        stages = list(stages)
        per = min(VIEW_PER_STAGE, max(1, VIEW_MAX // max(1, len(stages))))
        start = zlib.crc32(key.encode())
        out: list[cm.MemberView] = []
        entries = self._entries
        for s in stages:
            quota = min(per, VIEW_MAX - len(out))
            for peers in reversed(self._lists[s]):  # serving ones first
                n = len(peers)
                take = min(n, quota)
                if take < n:  # the window of `take` peers from `first`, wrapping around the end
                    first = start % n
                    window = peers[first:first + take]
                    if len(window) < take:
                        window += peers[:take - len(window)]
                else:
                    window = peers
                out.extend([entries[p] for p in window])
                quota -= take
        return out

    def encoded_bytes(self, members: list[cm.MemberView]) -> int:
        """The bytes ``members`` (this view's entries) take in an encoded reply, each entry encoded once: a join
        reply's size check encoded up to ``VIEW_MAX`` entries per join, most of the cost of a join at scale."""
        sizes, total = self._sizes, 0
        for e in members:
            got = sizes.get(e.peer_id)
            if got is None or got[0] is not e:
                got = sizes[e.peer_id] = (e, record_size(e))
            total += got[1]
        return total

    def update_for(self, peer_id: str, stages: tuple[int, ...], version: int, *, delta: bool) -> ViewUpdate | None:
        """What ``peer_id``, holding ``version`` of a view of ``stages``, needs to be told (None: nothing)."""
        same_basis = self._basis.get(peer_id) == stages
        if same_basis and not self.changed(stages, version) and not (delta and self._departed > version):
            if delta and version != self.version:
                # Nothing for it, but move it to the current version, so that it stays within the log.
                return ViewUpdate(self.version, [], delta=True)
            return None
        if delta and same_basis and self._current(version) and version >= self._log_floor:
            update = self._delta(stages, version)
            if len(update.members) <= VIEW_MAX:
                return update
        return self.full(peer_id, stages)

    def full(self, peer_id: str, stages: tuple[int, ...]) -> ViewUpdate:
        """A snapshot of ``stages`` for ``peer_id``, remembered as the basis of its deltas."""
        self._basis[peer_id] = stages
        return ViewUpdate(self.version, self.snapshot(stages, peer_id))

    def _delta(self, stages: tuple[int, ...], version: int) -> ViewUpdate:
        near = set(stages)
        # Only the changes that touch `stages` and the departures can make a peer upserted or removed: one that is
        # inside now got there by a change into `stages` (or has not moved since one that touched them), and a
        # departure is indexed under the stage it left too.
        departed: set[str] = set()  # stopped being live since `version`
        was_near: set[str] = set()  # was in `stages` before one of its changes since `version`
        changed: set[str] = set()
        for c in reversed(self._departures):
            if c.version <= version:
                break
            departed.add(c.peer_id)
        for s in stages:
            for c in reversed(self._stage_log[s]):
                if c.version <= version:
                    break
                changed.add(c.peer_id)
                if c.was_stage in near:
                    was_near.add(c.peer_id)
        upserts, removed = [], []
        entries = self._entries
        for peer in changed | departed:
            entry = entries.get(peer)
            inside = entry is not None and entry.stage in near
            # Gone, or gone and back (its old routes broke all the same), or moved out of the neighbourhood.
            if entry is None or peer in departed or (peer in was_near and not inside):
                removed.append(peer)
            if inside:
                upserts.append(entry)
        upserts.sort(key=_BY_PEER)
        removed.sort()
        return ViewUpdate(self.version, upserts, removed, delta=True)
