"""Membership: join, second join refused, heartbeats, leave, expiry, rejoin to the old stage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.assignment import ThroughputClaims, shares_from_layers, stage_loads
from protolearn.coordinator.core.members import EXPIRED, LEFT, LIVE, HeartbeatInfo, JoinInfo
from protolearn.coordinator.core.registry import Registry


def registry(num_stages: int = 2) -> Registry:
    s = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=3.0, move_cooldown_s=0.0, departed_retention_s=100.0)
    return Registry(num_stages, shares_from_layers([1] * num_stages), s)


def info(t: float = 100.0) -> JoinInfo:
    return JoinInfo(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=t)


def test_joins_fill_stages_and_a_second_join_of_a_live_peer_is_refused() -> None:
    r = registry()
    assert r.join("a", info(), 0.0).stage == 0
    assert r.join("b", info(), 0.0).stage == 1
    d = r.join("a", info(), 1.0)
    assert not d.accepted and d.code == "already_joined"
    assert r.members["a"].joined_at == 0.0


def test_heartbeat_updates_state_and_view_version_only_on_structural_change() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    v0 = r.view_version
    assert r.heartbeat("a", HeartbeatInfo("training", 120.0, 2, 4, "h4", 2.5), 1.0).accepted
    m = r.members["a"]
    assert (m.state, m.throughput, m.queue_len, m.step, m.param_hash, m.loss) == ("training", 120.0, 2, 4, "h4", 2.5)
    assert r.view_version == v0 + 1
    r.heartbeat("a", HeartbeatInfo("training", 130.0), 2.0)
    assert r.view_version == v0 + 1
    assert r.heartbeat("zz", HeartbeatInfo("training"), 2.0).code == "not_member"


def test_expiry_after_missed_heartbeats_and_rejoin_gets_the_old_stage() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    r.join("c", info(), 0.0)  # stage 0 (tie → lower index)
    assert r.members["c"].stage == 0
    r.heartbeat("a", HeartbeatInfo("training"), 2.0)
    r.heartbeat("b", HeartbeatInfo("training"), 2.0)
    assert [m.peer_id for m in r.expire(3.5)] == ["c"]
    assert r.members["c"].status == EXPIRED
    assert r.heartbeat("c", HeartbeatInfo("training"), 3.6).code == "not_member"
    d = r.join("c", info(), 4.0)
    assert d.accepted and d.rejoined and d.stage == 0


def test_expiry_counts_from_each_members_last_heartbeat_through_rejoins_and_restarts() -> None:
    """Expiry visits the deadlines it noted, not every member: each heartbeat's note replaces the older ones,
    a rejoin's old notes count for nothing, and a restart notes every restored member afresh."""
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    r.heartbeat("a", HeartbeatInfo("training"), 2.0)
    r.heartbeat("a", HeartbeatInfo("training"), 4.0)
    assert [m.peer_id for m in r.expire(3.5)] == ["b"]
    assert r.expire(6.9) == []  # a was heard from at 4.0
    assert [m.peer_id for m in r.expire(7.5)] == ["a"]
    r.join("b", info(), 8.0)  # back: its notes from before count for nothing
    r.leave("b", 9.0)
    r.join("b", info(), 10.0)
    r.leave("b", 60.0)
    r.expire(110.0)  # a, expired at 7.5, is forgotten; b's first leave (9.0) is no longer its departure
    assert "a" not in r.members and r.members["b"].status == LEFT
    r.expire(161.0)
    assert "b" not in r.members
    r.join("c", info(), 200.0)
    members = list(r.members.values())
    again = registry()
    again.restore(members, 500.0)  # silent since 200.0, but the restart counts it as seen now
    assert again.expire(502.0) == []
    assert [m.peer_id for m in again.expire(again.grace_until + 3.5)] == ["c"]


def test_a_member_that_heartbeats_without_pause_keeps_one_note_in_the_expiry_heap() -> None:
    """Hostile input is normal input: heartbeats as fast as admission lets them through must not grow the
    registry's memory; each member has one note, moved along when it comes up."""
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    for i in range(1, 2001):
        r.heartbeat("a", HeartbeatInfo("training"), i * 0.01)
        if i % 100 == 0:
            assert [m.peer_id for m in r.expire(i * 0.01)] == (["b"] if i == 400 else [])
    assert len(r._seen) <= 2 and len(r._departed) <= 1
    assert [m.peer_id for m in r.expire(20.0 + 3.1)] == ["a"]


def test_rejoin_goes_to_a_halted_stage_instead_of_its_old_one() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    r.join("c", info(), 0.0)
    assert r.members["c"].stage == 0
    r.leave("c", 1.0)
    r.leave("b", 1.0)  # stage 1 is now empty
    assert r.members["b"].status == LEFT
    d = r.join("c", info(), 2.0)
    assert d.rejoined and d.stage == 1


def test_departed_members_are_forgotten_after_retention() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.leave("a", 1.0)
    r.expire(50.0)
    assert "a" in r.members
    r.expire(200.0)
    assert "a" not in r.members and r.removed == {"a"}


def test_rebalance_moves_a_training_node_into_an_empty_stage() -> None:
    r = registry(3)
    for p in "abc":
        r.join(p, info(), 0.0)
    for p in "abc":
        r.heartbeat(p, HeartbeatInfo("training"), 1.0)
    r.leave("c", 2.0)
    assert r.rebalance(3.0) is None  # no stage can spare a replica
    r.join("d", info(), 3.0)  # goes to the empty stage 2
    assert r.members["d"].stage == 2
    r.join("e", info(), 3.0)
    r.heartbeat("e", HeartbeatInfo("training"), 4.0)
    r.leave("d", 5.0)
    for p in "abe":
        r.heartbeat(p, HeartbeatInfo("training"), 5.5)
    move = r.rebalance(6.0)
    assert move is not None and move.dst == 2 and r.members[move.peer_id].stage == 2
    assert r.heartbeat(move.peer_id, HeartbeatInfo("syncing"), 6.5).reason == move.reason


def test_rebalance_never_takes_a_stage_s_last_replica_that_is_heard_from() -> None:
    """A replica that went silent may be dead and not yet expired: counted as the one left behind, it let a
    move take its stage's only working replica, and the stage's state was gone (the chaos e2e test hung)."""
    r = registry(3)
    for p in "abcd":
        r.join(p, info(), 0.0)
    for p in "abcd":
        r.heartbeat(p, HeartbeatInfo("training"), 1.0)
    assert [r.members[p].stage for p in "abcd"] == [0, 1, 2, 0]
    r.leave("c", 1.5)  # stage 2 is empty; stage 0 has two replicas, a and d
    r.heartbeat("a", HeartbeatInfo("training"), 3.5)  # d is silent since 1.0 (dead, say: it expires at 4.0)
    assert r.rebalance(3.5) is None  # moving a would leave stage 0 only the silent d, and moving d fills nothing
    r.heartbeat("d", HeartbeatInfo("training"), 3.6)
    move = r.rebalance(3.7)
    assert move is not None and move.src == 0 and move.dst == 2


def test_no_rebalance_during_a_restart_s_grace() -> None:
    """Right after a restart every restored member looks just seen, the dead too: no move until the grace ends."""
    r = registry(3)
    for p in "abcd":
        r.join(p, info(), 0.0)
    r.leave("c", 0.5)
    for p in "abd":
        r.heartbeat(p, HeartbeatInfo("training"), 1.0)
    r.restore([m for m in r.members.values()], 1.0)
    assert r.grace_until > 1.0
    assert r.rebalance(1.5) is None
    for p in "abd":
        r.heartbeat(p, HeartbeatInfo("training"), r.grace_until)
    assert r.rebalance(r.grace_until) is not None


def test_drain_hands_over_changed_and_forgotten_members_once_and_telemetry_only_when_soft() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    changed, removed = r.drain()
    assert [m.peer_id for m in changed] == ["a", "b"] and removed == []
    assert r.drain() == ([], [])
    r.heartbeat("a", HeartbeatInfo("syncing", 150.0), 1.0)  # telemetry only: written lazily
    assert r.drain() == ([], [])
    changed, _ = r.drain(soft=True)
    assert [(m.peer_id, m.throughput) for m in changed] == [("a", 150.0)]
    assert r.drain(soft=True) == ([], [])
    r.leave("b", 2.0)
    r.expire(200.0)  # a expires, the departed b is forgotten
    changed, removed = r.drain()
    assert [(m.peer_id, m.status) for m in changed] == [("a", EXPIRED)] and removed == ["b"]


def test_restore_loads_members_with_a_fresh_term_and_nothing_to_persist() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.join("b", info(), 0.0)
    r.leave("b", 1.0)
    members = [r.members["a"], r.members["b"]]
    again = registry()
    again.restore(members, 50.0)
    assert again.is_live("a") and not again.is_live("b") and again.members["b"].status == LEFT
    assert again.members["a"].last_seen == 50.0 and again.drain(soft=True) == ([], [])
    assert again.expire(50.0 + 3.5) == []  # the restart grace: nodes are still reconnecting
    assert again.join("b", info(), 51.0).rejoined


OPS = st.lists(
    st.tuples(
        st.sampled_from(["join", "beat", "leave", "ban", "expire", "rebalance", "restore"]),
        st.integers(0, 5),  # which peer
        st.sampled_from(["syncing", "training", "averaging", "leaving"]),
        st.sampled_from([0.0, 1e-9, 0.3, 100.0, 1e6]),  # throughput
        st.integers(-1, 2),  # the stage it says it serves
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_per_stage_tallies_always_equal_a_fresh_count_of_the_members(ops) -> None:
    """The O(1) counts behind join, lease and stage choice never drift from the members they count."""
    r = registry(3)
    now = 0.0
    for op, k, state, thr, serving in ops:
        peer, now = f"p{k}", now + 0.7
        if op == "join":
            r.join(peer, info(thr), now)
        elif op == "beat":
            r.heartbeat(peer, HeartbeatInfo(state, thr, stage=serving), now)
        elif op == "leave":
            r.leave(peer, now)
        elif op == "ban":
            r.ban(peer, now)
        elif op == "expire":
            # Expiry visits only the deadlines it noted: it must find what a scan of every member finds.
            t = now + (2.5 if k % 2 else 150.0)  # past the expiry, or past the departed ones' retention too
            silent = [] if t < r.grace_until else sorted(
                p for p, m in r.members.items() if m.status == LIVE and t - m.last_seen > r.expiry_s
            )
            forgotten = sorted(
                p for p, m in r.members.items() if m.status in (LEFT, EXPIRED) and t - m.left_at > r.settings.departed_retention_s
            )
            assert sorted(m.peer_id for m in r.expire(t)) == silent
            assert not set(forgotten) & set(r.members) and set(forgotten) <= r.removed
        elif op == "rebalance":
            r.rebalance(now)
        else:
            members = list(r.members.values())
            r = registry(3)
            r.restore(members, now)
        live = list(r.live())
        assert r.num_live == len(live)
        claims = ThroughputClaims()
        for m in live:
            claims.add(m.throughput)
        typical = claims.lower_median() or 0.0  # what a member that has not measured yet counts as
        fresh = stage_loads(((m.stage, m.throughput if m.throughput > 0 else typical) for m in live), 3)
        assert [x.replicas for x in r.loads()] == [x.replicas for x in fresh]
        assert [x.throughput for x in r.loads()] == pytest.approx([x.throughput for x in fresh], rel=1e-12, abs=1e-6)
        for s in range(3):
            working = sorted(m.peer_id for m in live if m.stage == s and m.serving in (-1, s) and m.state in ("training", "averaging"))
            assert r.working(s) == len(working) and r.serving(s) == working  # nobody disconnected here


def test_a_flip_between_training_and_averaging_is_no_view_change() -> None:
    r = registry()
    r.join("a", info(), 0.0)
    r.heartbeat("a", HeartbeatInfo("training"), 1.0)
    v = r.view_version
    r.heartbeat("a", HeartbeatInfo("averaging"), 2.0)
    r.heartbeat("a", HeartbeatInfo("training"), 3.0)
    assert r.view_version == v and r.members["a"].state == "training" and r.working(0) == 1
    r.heartbeat("a", HeartbeatInfo("leaving"), 4.0)
    assert r.view_version == v + 1 and r.working(0) == 0


def test_leaving_and_rejoining_cannot_steer_identities_into_a_stage() -> None:
    # Issue 27: identities that join, leave at once if placed in the target stage, and rejoin later all went
    # back there (their "previous stage"): six of six grew stage 1 from 7 to 13 replicas.
    r = registry()
    for p in ("a", "b", "c"):
        r.join(p, info(), 0.0)  # a, c in stage 0; b in stage 1
        r.heartbeat(p, HeartbeatInfo("training", 100.0, 0, 3, "h3"), 0.5)
    pool = []
    for k in range(6):
        sybil = f"s{k}"
        if r.join(sybil, info(), 1.0).stage == 1:  # stage 1 is the least loaded: each lands there
            pool.append(sybil)
        r.leave(sybil, 1.0)
    assert len(pool) == 6
    r.join("d", info(), 2.0)  # an honest joiner evens the stages (2 and 2)
    for sybil in pool:
        d = r.join(sybil, info(), 3.0)
        assert d.accepted and d.rejoined
    loads = r.loads()
    assert loads[1].replicas <= loads[0].replicas + 1, f"rejoins steered into stage 1: {[x.replicas for x in loads]}"


def test_a_returning_identity_that_holds_its_stages_state_goes_back_to_it() -> None:
    r = registry()
    for p in ("a", "b", "c", "e"):
        r.join(p, info(), 0.0)  # a, c in stage 0; b, e in stage 1
    for p in ("a", "b", "c", "e"):
        r.heartbeat(p, HeartbeatInfo("training", 100.0, 0, 3, "h3" if p != "c" else "h3-stage0"), 0.5)
    r.heartbeat("a", HeartbeatInfo("training", 100.0, 0, 3, "h3-stage0"), 0.5)
    assert r.members["e"].stage == 1
    r.leave("e", 1.0)
    r.join("f", info(), 1.5)  # stage 1 (least loaded); then stage 0 is the one a newcomer would get
    d = r.join("e", info(), 2.0)
    assert d.rejoined and d.stage == 1, "its last hash is stage 1's majority at step 3: its state is worth reusing"
    # One that reported a hash the stage's replicas did not hold is placed like a newcomer.
    r.heartbeat("e", HeartbeatInfo("training", 100.0, 0, 3, "forged"), 2.5)
    r.leave("e", 3.0)
    assert r.join("e", info(), 3.5).stage == 0


def test_after_a_whole_swarm_restart_each_identity_with_state_goes_back_to_its_stage() -> None:
    # Nobody serves its old stage to compare with: a node restoring its checkpoint must get its stage back.
    r = registry()
    r.join("head", info(), 0.0)
    r.join("tail", info(), 0.0)
    for p in ("head", "tail"):  # no hash reported: a restarted coordinator keeps none
        r.leave(p, 1.0)
    assert r.join("tail", info(), 2.0).stage == 1, "its old stage 1 is empty: it goes back, not to stage 0"
    assert r.join("head", info(), 2.1).stage == 0
