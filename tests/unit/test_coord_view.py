"""The membership view nodes get: their neighbourhood, bounded, and only what changed (snapshots or deltas).

A small simulator drives a core with random joins, leaves, bans, state changes and moves, while fake
nodes heartbeat and apply what they are told, as node code does (replace on a snapshot; drop
``removed`` then upsert ``members`` on a delta). After every beat each node's view must equal the live
members of its neighbourhood.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.members import LIVE, Member
from protolearn.coordinator.core.view import LOG_LEN, VIEW_MAX, VIEW_PER_STAGE, SwarmView
from protolearn.protocol import coordination as cm
from protolearn.protocol.bounds import MAX_PEER_ID
from protolearn.protocol.wire import decode, encode
from tests.support.coordinator import make_core, run_info

SETTINGS = CoordinatorSettings(rate_per_s=1e9, rate_burst=1e9, expiry_s=3.0, move_cooldown_s=0.0, max_members=1_000_000)
# protocol/transport TransportConfig.max_message_bytes: the largest frame a node reads.
FRAME_CAP = 16 * 1024 * 1024


def member(i: int, stage: int, *, long: bool = False) -> Member:
    peer = f"{i:06d}".ljust(MAX_PEER_ID, "x") if long else f"p{i:06d}"
    addrs = [f"/dns4/{k}.{'h' * 200}/tcp/4001".ljust(cm.MAX_ADDR, "0")[: cm.MAX_ADDR] for k in range(cm.MAX_ADDRS)] if long else ["/ip4/10.0.0.1/tcp/1"]
    return Member(peer_id=peer, addrs=addrs, device="cpu", memory_gb=1.0, throughput=100.0, stage=stage, joined_at=0.0,
                  last_seen=0.0, state="training", serving=stage)


def populated(num_stages: int, per_stage: int, *, long: bool = False, now: float = 0.0) -> CoordinatorCore:
    core = make_core(run_info(num_stages), SETTINGS, started_at=now)
    members = [member(i, i % num_stages, long=long) for i in range(num_stages * per_stage)]
    core.restore(members=members, step=0, tickets=[], closed=[], history=[], bans=[], now=now)
    return core


class FakeNode:
    """Keeps a view the way node code does (node/coordinator_link.py, plus the delta merge)."""

    def __init__(self, core: CoordinatorCore, peer: str, now: float, *, delta: bool) -> None:
        self.peer, self.delta = peer, delta
        self.live_before: set[str] | None = None
        reply = core.handle(peer, cm.Join(addrs=["/ip4/10.0.0.2/tcp/1"], throughput=100.0), now)
        self.stage, self.version = reply.stage, reply.view_version
        self.view = {m.peer_id: m for m in reply.members}

    def beat(self, core: CoordinatorCore, now: float, state: str = "training") -> cm.HeartbeatReply:
        hb = cm.Heartbeat(state=state, view_version=self.version, view_delta=self.delta, stage=self.stage)
        reply = core.handle(self.peer, hb, now)
        if reply.view_changed:
            if reply.view_delta:
                for p in reply.removed:
                    self.view.pop(p, None)
                self.view.update({m.peer_id: m for m in reply.members})
            else:
                self.view = {m.peer_id: m for m in reply.members}
            self.version = reply.view_version
        self.stage = reply.stage
        return reply


def thin(core: CoordinatorCore, stage: int, now: float = 0.5) -> None:
    """One replica of ``stage`` leaves, so that the next joiner goes there."""
    core.handle(next(m.peer_id for m in core.registry.live() if m.stage == stage), cm.Leave(), now)


def truth(core: CoordinatorCore, stages) -> dict[str, int]:
    return {m.peer_id: m.stage for m in core.registry.live() if m.stage in stages}


def test_a_delta_node_is_told_about_its_own_and_the_neighbouring_stages_only() -> None:
    core = populated(8, 3)
    thin(core, 4)
    node = FakeNode(core, "me", 1.0, delta=True)
    assert node.stage == 4 and {m.stage for m in node.view.values()} == set(range(8))  # the join reply: a snapshot
    reply = node.beat(core, 1.5)  # its first delta beat: a snapshot of the neighbourhood, then deltas
    assert reply.view_changed and not reply.view_delta
    assert {p: m.stage for p, m in node.view.items()} == truth(core, {3, 4, 5})
    assert reply.stage_replicas == [3] * 8  # serving replicas per stage, "me" included now it trains


def test_a_stage0_node_taking_snapshots_sees_every_stage_and_notices_a_far_departure() -> None:
    """node.py diffs successive views to restart the tickets routed through a departed member."""
    core = populated(4, 2)
    thin(core, 0)
    node = FakeNode(core, "me", 1.0, delta=False)
    assert node.stage == 0 and {m.stage for m in node.view.values()} == {0, 1, 2, 3}
    far = next(p for p, m in node.view.items() if m.stage == 3)
    core.handle(far, cm.Leave(reason="bye"), 2.0)
    before = set(node.view)
    assert node.beat(core, 2.5).view_changed and before - set(node.view) == {far}


@pytest.mark.parametrize("delta", [False, True])
def test_a_current_view_costs_nothing(delta: bool) -> None:
    core = populated(8, 3)
    thin(core, 4)
    node = FakeNode(core, "me", 1.0, delta=delta)
    assert node.beat(core, 1.4).view_changed  # syncing -> training: its own entry changes
    for now in (1.5, 1.6):
        reply = node.beat(core, now)
        assert not reply.view_changed and reply.members == [] and reply.removed == []
    near = next(m.peer_id for m in core.registry.live() if m.stage == node.stage and m.peer_id != "me")
    core.handle(near, cm.Leave(), 3.0)
    reply = node.beat(core, 3.5)
    assert reply.view_changed and reply.view_delta == delta and near not in node.view
    assert reply.stage_replicas == [3, 3, 3, 3, 2, 3, 3, 3]


def test_a_delta_carries_what_changed_and_every_departure_but_not_far_state_changes() -> None:
    core = populated(8, 3)
    thin(core, 4)
    node = FakeNode(core, "me", 1.0, delta=True)
    s = node.stage
    assert s == 4
    node.beat(core, 1.5)  # syncing -> training: its own entry changes
    near_peer = next(m.peer_id for m in core.registry.live() if m.stage == s and m.peer_id != "me")
    near = [m.peer_id for m in core.registry.live() if abs(m.stage - s) == 1]
    far = [m.peer_id for m in core.registry.live() if abs(m.stage - s) > 1]
    core.handle(far[0], cm.Heartbeat(state="syncing", stage=core.registry.members[far[0]].stage), 2.0)  # far: not sent
    core.handle(far[1], cm.Leave(), 2.0)  # a departure anywhere: removed
    core.handle(near_peer, cm.Leave(), 2.0)
    # Gone and back: removed, then upserted where it now is. (It held no committed state, so it was placed
    # like a newcomer, here far away: the delta removes it and does not carry it back.)
    core.handle(near_peer, cm.Join(addrs=["/ip4/10.0.0.9/tcp/1"]), 2.1)
    assert abs(core.registry.members[near_peer].stage - s) > 1
    core.handle(near[0], cm.Leave(), 2.2)
    core.handle(near[0], cm.Join(addrs=["/ip4/10.0.0.9/tcp/2"], throughput=1e9), 2.3)
    assert abs(core.registry.members[near[0]].stage - s) <= 1, "placed near this time: upserted"
    reply = node.beat(core, 2.5)
    assert reply.view_delta and sorted(reply.removed) == sorted([far[1], near_peer, near[0]])
    assert [m.peer_id for m in reply.members] == [near[0]]
    assert len(encode(reply)) < 1024  # a few changes, not the swarm
    assert decode(encode(reply), peer="coord", expect=cm.HeartbeatReply) == reply
    assert {p: m.stage for p, m in node.view.items()} == truth(core, {s - 1, s, s + 1})


def test_a_departure_anywhere_reaches_every_node_but_far_state_changes_only_snapshot_nodes() -> None:
    """A stage-0 node restarts the tickets it routed through a departed member, whatever its stage."""
    core = populated(8, 3)
    thin(core, 0)
    first = FakeNode(core, "first", 1.0, delta=True)
    thin(core, 4)
    middle = FakeNode(core, "middle", 1.0, delta=False)
    assert (first.stage, middle.stage) == (0, 4)
    for node in (first, middle):
        node.beat(core, 1.5)
        node.beat(core, 1.6)
    far = next(m.peer_id for m in core.registry.live() if m.stage == 7)
    core.handle(far, cm.Leave(), 2.0)
    reply = first.beat(core, 2.5)
    assert reply.view_delta and reply.removed == [far] and reply.members == []
    before = set(middle.view)
    reply = middle.beat(core, 2.5)
    assert reply.view_changed and not reply.view_delta and before - set(middle.view) == {far}
    core.handle("late", cm.Join(addrs=["/ip4/10.0.0.3/tcp/1"]), 3.0)  # joins stage 7: far from both
    reply = first.beat(core, 3.5)
    assert reply.view_delta and (reply.members, reply.removed) == ([], []) and first.version == core.registry.view_version
    assert not first.beat(core, 3.6).view_changed
    assert middle.beat(core, 3.6).view_changed and "late" in middle.view


def test_a_node_further_behind_than_the_log_or_from_another_run_gets_a_snapshot() -> None:
    core = populated(2, 1)
    node = FakeNode(core, "me", 1.0, delta=True)
    for i in range(LOG_LEN // 2 + 1):  # two changes each
        core.handle(f"churn{i}", cm.Join(addrs=["/ip4/10.0.0.4/tcp/1"]), 2.0)
        core.handle(f"churn{i}", cm.Leave(), 2.0)
    reply = node.beat(core, 3.0)
    assert reply.view_changed and not reply.view_delta
    assert {p: m.stage for p, m in node.view.items()} == truth(core, {0, 1})
    members = list(core.registry.members.values())
    again = make_core(run_info(2), SETTINGS, started_at=1000.0)
    again.restore(members=members, step=0, tickets=[], closed=[], history=[], bans=[], now=1000.0)
    assert again.registry.view_version > core.registry.view_version  # a later run's versions never meet ours
    reply = again.handle("me", cm.Heartbeat(state="training", view_version=node.version, view_delta=True), 1001.0)
    assert reply.view_changed and not reply.view_delta and len(reply.members) == len(truth(again, {0, 1}))


def test_snapshots_are_bounded_and_spread_over_a_large_stage() -> None:
    per_stage = VIEW_PER_STAGE * 3
    core = populated(2, per_stage)
    seen: set[str] = set()
    for i in range(12):
        reply = core.handle(f"new{i}", cm.Join(addrs=["/ip4/10.0.0.5/tcp/1"]), 1.0)
        by_stage = [sum(1 for m in reply.members if m.stage == s) for s in (0, 1)]
        assert by_stage == [VIEW_PER_STAGE, VIEW_PER_STAGE]
        seen |= {m.peer_id for m in reply.members}
    assert len(seen) > 3 * VIEW_PER_STAGE  # different joiners see different replicas


def test_a_snapshot_lists_a_large_stages_serving_replicas_first() -> None:
    """Else a node could see only syncing replicas of the next stage, and route nowhere."""
    core = make_core(run_info(2), SETTINGS)
    members = [member(i, i % 2) for i in range(4 * VIEW_PER_STAGE)]
    for m in members[:-4]:
        m.state = "syncing"
    core.restore(members=members, step=0, tickets=[], closed=[], history=[], bans=[], now=0.0)
    for k in range(5):
        reply = core.handle(f"new{k}", cm.Join(addrs=["/ip4/10.0.0.5/tcp/1"]), 1.0)
        assert {m.peer_id for m in reply.members if m.state.live} == {m.peer_id for m in members[-4:]}
        assert len(reply.members) == 2 * VIEW_PER_STAGE


def test_a_join_reply_stays_under_the_frame_cap_with_the_largest_entries() -> None:
    core = populated(4, 400, long=True)
    reply = core.handle("new", cm.Join(addrs=["/ip4/10.0.0.6/tcp/1"]), 1.0)
    assert len(reply.members) == VIEW_MAX
    assert len(encode(reply)) < FRAME_CAP / 2
    members = core.handle("operator", cm.MembersRequest(), 1.0)
    assert len(members.members) <= VIEW_MAX and len(encode(members)) < FRAME_CAP / 2


def test_the_view_module_keeps_its_stage_lists_consistent_through_moves() -> None:
    v = SwarmView(3)
    entries = {p: cm.MemberView(peer_id=p, stage=i % 3, addrs=[], state="training", throughput=1.0, queue_len=0) for i, p in enumerate("abcdef")}
    for e in entries.values():
        v.put(e)
    v.put(entries["a"].model_copy(update={"stage": 2}))
    v.drop("e")
    v.drop("e")  # twice: no change
    assert sorted(m.peer_id for m in v.snapshot([2], "x")) == ["a", "c", "f"]
    assert sorted(m.peer_id for m in v.snapshot([0, 1], "x")) == ["b", "d"]
    assert len(v) == 5


OPS = st.lists(
    st.tuples(st.sampled_from(["join", "leave", "ban", "sync", "train", "rebalance", "expire"]), st.integers(0, 14)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(0, 2**32))
def test_simulated_nodes_views_always_match_their_neighbourhood(ops, seed: int) -> None:
    rng = random.Random(seed)
    core = make_core(run_info(5), SETTINGS.model_copy(update={"expiry_s": 100.0}))  # only the "expire" op silences members
    now = 0.0
    nodes = [FakeNode(core, f"node{k}", now, delta=k % 2 == 0) for k in range(6)]
    for op, k in ops:
        now += 0.5
        peer = f"x{k}"
        m = core.registry.members.get(peer)
        live = m is not None and m.status == LIVE
        if op == "join" and not live and not core.verdicts.is_banned(peer):
            core.handle(peer, cm.Join(addrs=["/ip4/10.0.0.7/tcp/1"], throughput=rng.choice([1.0, 100.0, 1e4])), now)
        elif op in ("sync", "train") and live:
            state = "syncing" if op == "sync" else rng.choice(["training", "averaging"])
            core.handle(peer, cm.Heartbeat(state=state, stage=m.stage), now)
        elif op == "leave" and live:
            core.handle(peer, cm.Leave(), now)
        elif op == "ban" and m is not None:
            core.ban(peer, "test", now)
        elif op == "rebalance":
            core.registry.rebalance(now)
        elif op == "expire":
            # Every member but the observing nodes falls silent past the expiry: the nodes beat later, then expiry runs.
            now += 101.0
            for node in nodes:
                _beat_and_check(core, node, now)
            core.housekeeping(now)
        for node in nodes:
            if rng.random() < 0.6:
                _beat_and_check(core, node, now)


def _beat_and_check(core: CoordinatorCore, node: FakeNode, now: float) -> None:
    """``node`` heartbeats; its view must then match its neighbourhood, every departure since its last beat reported."""
    reply = node.beat(core, now)
    live_now = {x.peer_id for x in core.registry.live()}
    snapshot = reply.view_changed and not reply.view_delta  # after a move: replaces the view
    if node.delta and node.live_before is not None and not snapshot:
        assert node.live_before - live_now <= set(reply.removed), "a departure was not reported"
    node.live_before = live_now
    me = core.registry.members[node.peer]
    stages = core._view_stages(me, delta=node.delta)
    assert {p: v.stage for p, v in node.view.items() if p != node.peer} == {
        p: s for p, s in truth(core, stages).items() if p != node.peer
    }, (node.peer, node.delta, stages)


class _NoScan(dict):
    """The registry's members, refusing to be iterated: a request that scans every member fails."""

    def _scan(self, *args, **kwargs):
        raise AssertionError("a request scanned every member")

    __iter__ = values = items = keys = _scan  # type: ignore[assignment]


@pytest.mark.parametrize("stages", [2, 8])
def test_join_heartbeat_and_lease_never_scan_the_members(stages: int) -> None:
    """What keeps them O(1) in the swarm's size (scripts/bench.py coordinator measures it)."""
    core = populated(stages, 50)
    stage0 = next(m.peer_id for m in core.registry.live() if m.stage == 0)
    other = next(m.peer_id for m in core.registry.live() if m.stage == stages - 1)
    core.registry.members = _NoScan(core.registry.members)
    for peer in (stage0, other):
        for delta in (False, True):
            version = core.handle(peer, cm.Heartbeat(state="training", view_delta=delta), 1.0).view_version
            assert not core.handle(peer, cm.Heartbeat(state="averaging", view_version=version, view_delta=delta), 1.5).view_changed
    lease = core.handle(stage0, cm.Lease(max_tickets=1), 2.0)
    assert lease.indices
    core.handle(stage0, cm.Release(step=lease.step, indices=lease.indices), 2.0)
    reply = core.handle("newcomer", cm.Join(addrs=["/ip4/10.0.0.8/tcp/1"]), 3.0)
    assert reply.members and core.handle("newcomer", cm.Leave(), 3.0).released == []


def _delta_over_the_whole_log(view: SwarmView, stages: tuple[int, ...], version: int) -> tuple[list[cm.MemberView], list[str]]:
    """A delta as the module docstring defines it, read from every change in the log since ``version``."""
    near = set(stages)
    flags: dict[str, list[bool]] = {}
    for c in reversed(view._log):
        if c.version <= version:
            break
        f = flags.setdefault(c.peer_id, [False, False])
        f[0] = f[0] or c.departed
        f[1] = f[1] or c.was_stage in near
    upserts, removed = [], []
    for peer, (departed, was_near) in flags.items():
        entry = view.get(peer)
        inside = entry is not None and entry.stage in near
        if entry is None or departed or (was_near and not inside):
            removed.append(peer)
        if inside:
            upserts.append(entry)
    return sorted(upserts, key=lambda e: e.peer_id), sorted(removed)


def test_a_delta_read_from_its_stages_indexes_equals_one_read_from_the_whole_log() -> None:
    """Deltas read only the changes that touch the node's stages and the departures; seeded joins, moves, state
    changes and departures (past the log's length, so the indexes are trimmed too) give the same delta as a walk
    over every change since the node's version."""
    rng = random.Random(11)
    stages = 8
    view = SwarmView(stages, version=1000)
    live: list[str] = []
    for i in range(LOG_LEN + 3000):
        if live and rng.random() < 0.3:
            view.drop(live.pop(rng.randrange(len(live))))
        else:
            peer = rng.choice(live) if live and rng.random() < 0.5 else f"p{i}"
            if peer not in live:
                live.append(peer)
            view.put(cm.MemberView(peer_id=peer, stage=rng.randrange(-1, stages), addrs=[], state=rng.choice(["training", "syncing"]),
                                   throughput=1.0, queue_len=0))
        if i % 37 == 0:
            since = rng.randint(max(view._log_floor, view.version - 400), view.version)
            hood = view.neighbourhood(rng.randrange(stages), rng.choice([-1, rng.randrange(stages)]))
            got = view._delta(hood, since)
            assert (got.members, got.removed) == _delta_over_the_whole_log(view, hood, since), i


@pytest.mark.parametrize("live", [0, 1, 14, 15, 16, 17, 300])
def test_a_join_replys_size_counted_from_cached_entry_sizes_is_its_encoded_length(live: int) -> None:
    """The join's size check adds up each view entry's cached encoded size: it must be the reply's length exactly,
    across msgpack's array headers (15/16 entries) and after members changed (a cached size of an old entry unused)."""
    from protolearn.protocol.wire import encoded_size

    core = populated(2, live // 2 + live % 2, long=True) if live else make_core(run_info(2), SETTINGS)
    for k in range(3):
        reply = core.handle(f"new{k}", cm.Join(addrs=["/ip4/10.0.0.5/tcp/1"]), 1.0 + k)
        view = core.registry.view
        assert encoded_size(reply, "members", view.encoded_bytes(reply.members), len(reply.members)) == len(encode(reply))
        assert all(view._sizes[m.peer_id][0] is m for m in reply.members)  # the reply holds the view's own entries


def test_a_snapshots_windows_are_each_stages_peers_from_the_keys_place_wrapping_around() -> None:
    """Each stage's window in a snapshot is ``take`` consecutive peers from ``crc32(key) % n``, wrapping past the
    end (the module docstring's rule, written out here with a modulo per peer as it first was)."""
    import zlib

    rng = random.Random(3)
    for stages, per_stage in ((3, 500), (8, 140), (40, 30), (2, 7)):
        view = SwarmView(stages)
        for i in range(stages * per_stage):
            view.put(cm.MemberView(peer_id=f"q{i}", stage=i % stages, addrs=[], state=rng.choice(["training", "syncing"]),
                                   throughput=1.0, queue_len=0))
        for key in ("a", "node-17", "zz"):
            for hood in (tuple(range(stages)), view.neighbourhood(rng.randrange(stages))):
                per = min(VIEW_PER_STAGE, max(1, VIEW_MAX // max(1, len(hood))))
                start, want = zlib.crc32(key.encode()), []
                for s in hood:
                    quota = min(per, VIEW_MAX - len(want))
                    for peers in reversed(view._lists[s]):
                        n = len(peers)
                        take = min(n, quota)
                        first = start % n if take < n else 0
                        want.extend(view.get(peers[(first + i) % n]) for i in range(take))
                        quota -= take
                assert view.snapshot(hood, key) == want
