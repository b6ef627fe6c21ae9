"""The membership view: what each node is told about the other members, bounded and incremental.

**Neighbourhood.** A node of stage ``s`` sends activations to stage ``s+1``, averages with and syncs
from ``s``, and sends gradients back to ``s-1``; so it is told about those three stages only (while
it moves, about those of both its old and its new stage). That is about 3/S of the swarm instead of
all of it.

**Versions.** Every change other nodes must see (a join, leave, expiry, ban or move, a state change
into or out of serving) takes the next version number. The view keeps, per stage, the version that
last changed it, and a log of the last :data:`LOG_LEN` changes. A node sends the version it holds,
and gets one of:

- nothing, when no stage of its neighbourhood changed since then: an O(1) check, whatever the size
  of the swarm, and the common case of a heartbeat;
- a *snapshot* (the default, which node code applies by replacing its list): the neighbourhood,
  bounded (below);
- a *delta*, when it asked for one (``Heartbeat.view_delta``): the members of its neighbourhood that
  changed since its version (``members``, to upsert) and the peers to drop (``removed``, applied
  first). ``removed`` names every member that stopped being live *anywhere* (a stage-0 node restarts
  the tickets it routed through a departed member, whatever its stage) and those that moved out of the
  neighbourhood. Its size follows the churn since the node's last beat, not the swarm's size. When
  nothing concerns the node but the version moved on, an empty delta moves it to the current version,
  so that it stays within the log. A version older than the log, from another coordinator run, or held
  for another neighbourhood (the node moved) gets a snapshot instead.

Compatibility: a stage-0 node in snapshot mode is told about every stage, as before. Its node code
notices a departure on any of its routes by comparing successive views, which needs them all.

**Bounds.** A snapshot holds at most :data:`VIEW_PER_STAGE` members of a stage and :data:`VIEW_MAX`
in all, so a join reply stays far below the frame cap however large the swarm (``VIEW_MAX`` entries of
at most ~4.4 KiB each, with the longest peer ID and 16 of the longest addresses). Of a larger stage,
each node sees a window that starts at a place derived from its own peer ID, so that nodes spread over
the stage's replicas rather than all routing to the same few. A delta is bounded by ``LOG_LEN``.

Versions start at a number derived from the coordinator's start time (:func:`first_version`), so a
node that still holds a version from before a coordinator restart is never mistaken for current.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from protolearn.protocol import coordination as cm

# Most members of one stage in a snapshot, and in all (at most MAX_STAGES stages get one each).
VIEW_PER_STAGE = 256
VIEW_MAX = 1024
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


class SwarmView:
    """The live members' view entries by stage, with per-stage versions and a change log."""

    def __init__(self, num_stages: int, version: int = 0, entries: Iterable[cm.MemberView] = ()) -> None:
        self.num_stages = num_stages
        self.version = version
        self._first = version
        self._entries: dict[str, cm.MemberView] = {}
        # Each stage's live peers, in no particular order (removal swaps the last one in), and where.
        self._stage_peers: list[list[str]] = [[] for _ in range(num_stages)]
        self._index: dict[str, int] = {}
        self._stage_version = [version] * num_stages
        self._log: deque[_Change] = deque()
        # A delta from a version at or after this one is complete (older changes left the log).
        self._log_floor = version
        # The neighbourhood each member's view was last built for: another one needs a snapshot.
        self._basis: dict[str, tuple[int, ...]] = {}
        # The version of the last departure anywhere (every delta reports those).
        self._departed = version
        for e in entries:  # the live members after a restart: no change to tell anyone about
            self._entries[e.peer_id] = e
            self._list(e.peer_id, e.stage)

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
        if old is not None and old.stage != entry.stage:
            self._unlist(peer, old.stage)
        if old is None or old.stage != entry.stage:
            self._list(peer, entry.stage)
        self._entries[peer] = entry
        self._record(_Change(self.version, peer, was, False), was, entry.stage)

    def drop(self, peer_id: str) -> None:
        """``peer_id`` stopped being live (left, expired, banned)."""
        old = self._entries.pop(peer_id, None)
        if old is None:
            return
        self.version += 1
        self._unlist(peer_id, old.stage)
        self._basis.pop(peer_id, None)
        self._departed = self.version
        self._record(_Change(self.version, peer_id, old.stage, True), old.stage)

    def _list(self, peer: str, stage: int) -> None:
        if 0 <= stage < self.num_stages:
            peers = self._stage_peers[stage]
            self._index[peer] = len(peers)
            peers.append(peer)

    def _unlist(self, peer: str, stage: int) -> None:
        i = self._index.pop(peer, None)
        if i is None:
            return
        peers = self._stage_peers[stage]
        last = peers.pop()
        if last != peer:
            peers[i] = last
            self._index[last] = i

    def _record(self, change: _Change, *stages: int) -> None:
        for s in stages:
            if 0 <= s < self.num_stages:
                self._stage_version[s] = change.version
        self._log.append(change)
        if len(self._log) > LOG_LEN:
            self._log_floor = self._log.popleft().version

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
        for s in stages:
            peers = self._stage_peers[s]
            n = len(peers)
            take = min(n, per, VIEW_MAX - len(out))
            first = start % n if take < n else 0
            out.extend(self._entries[peers[(first + i) % n]] for i in range(take))
        return out

    def update_for(self, peer_id: str, stages: tuple[int, ...], version: int, *, delta: bool) -> ViewUpdate | None:
        """What ``peer_id``, holding ``version`` of a view of ``stages``, needs to be told (None: nothing)."""
        same_basis = self._basis.get(peer_id) == stages
        if same_basis and not self.changed(stages, version) and not (delta and self._departed > version):
            if delta and version != self.version:
                # Nothing for it, but move it to the current version, so that it stays within the log.
                return ViewUpdate(self.version, [], delta=True)
            return None
        if delta and same_basis and self._current(version) and version >= self._log_floor:
            return self._delta(stages, version)
        return self.full(peer_id, stages)

    def full(self, peer_id: str, stages: tuple[int, ...]) -> ViewUpdate:
        """A snapshot of ``stages`` for ``peer_id``, remembered as the basis of its deltas."""
        self._basis[peer_id] = stages
        return ViewUpdate(self.version, self.snapshot(stages, peer_id))

    def _delta(self, stages: tuple[int, ...], version: int) -> ViewUpdate:
        near = set(stages)
        # peer → [it stopped being live since `version`, it was in `stages` before one of its changes]
        flags: dict[str, list[bool]] = {}
        for c in reversed(self._log):
            if c.version <= version:
                break
            f = flags.setdefault(c.peer_id, [False, False])
            f[0] = f[0] or c.departed
            f[1] = f[1] or c.was_stage in near
        upserts, removed = [], []
        for peer, (departed, was_near) in flags.items():
            entry = self._entries.get(peer)
            inside = entry is not None and entry.stage in near
            # Gone, or gone and back (its old routes broke all the same), or moved out of the neighbourhood.
            if entry is None or departed or (was_near and not inside):
                removed.append(peer)
            if inside:
                upserts.append(entry)
        upserts.sort(key=lambda e: (e.stage, e.peer_id))
        return ViewUpdate(self.version, upserts, sorted(removed), delta=True)
