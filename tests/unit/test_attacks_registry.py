"""Issue 12, attacks 7, 8 and 10, run as an attacker would: on the real coordinator core, with fake ``now``.

- 7: lies in heartbeats (throughput, parameter hash, step, state flips) and in ``CorpusCheck``;
- 8: a swarm of 100,000 members with the longest peer IDs and addresses must not push any reply past
  the frame cap, and a join that cannot be answered must not be registered;
- 10: a joiner installs a stage's state only if it is what the stage's majority reported
  (:func:`protolearn.node.syncing.judge_state`; tests/integration/test_state_sync.py runs it on real hosts).
"""

from __future__ import annotations

import time

import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.members import EXPIRED, Member
from protolearn.coordinator.core.view import VIEW_MAX
from protolearn.coordinator.errors import Refusal
from protolearn.node.syncing import judge_state
from protolearn.protocol import coordination as cm
from protolearn.protocol.majority import majority_state
from protolearn.protocol.bounds import MAX_HASH, MAX_PEER_ID
from protolearn.protocol.wire import encode
from tests.support.coordinator import join as join_core
from tests.support.coordinator import make_core, run_info

SETTINGS = CoordinatorSettings(rate_per_s=1e9, rate_burst=1e9, expiry_s=3.0, move_cooldown_s=0.0, max_members=1_000_000)
# protocol/transport TransportConfig.max_message_bytes: the largest frame a node reads.
FRAME_CAP = 16 * 1024 * 1024
ADDR = ["/ip4/10.0.0.2/tcp/1"]


def join(core: CoordinatorCore, peer: str, now: float = 0.0, throughput: float = 100.0) -> int:
    """The stage ``peer`` is given."""
    return join_core(core, peer, now, throughput=throughput, addrs=ADDR).stage


def refused(core: CoordinatorCore, peer: str, msg: cm.Message, now: float = 1.0) -> str:
    with pytest.raises(Refusal) as err:
        core.handle(peer, msg, now)
    return err.value.code


# -- attack 7: lies in heartbeats ------------------------------------------------------------------


def test_a_throughput_claim_of_1e15_does_not_steer_joiners_away_from_the_liars_stage() -> None:
    core = make_core(run_info(2), SETTINGS)
    for k in range(4):
        join(core, f"honest{k}")
    liar_stage = join(core, "liar", throughput=1e15)
    core.handle("liar", cm.Heartbeat(state="training", throughput=1e15), 0.5)
    # It counts as at most throughput_claim_factor honest nodes (bins are 2**(1/4) wide), not 1e13 of them.
    assert core.registry.members["liar"].throughput <= SETTINGS.throughput_claim_factor * 100.0 * 2**0.25
    stages = [join(core, f"new{k}", 1.0) for k in range(10)]
    # Before the bound, all ten went to the other stage and the liar held its stage alone.
    assert stages.count(liar_stage) >= 3, stages


def test_a_bogus_param_hash_does_not_flip_the_stages_agreed_hash() -> None:
    core = make_core(run_info(2), SETTINGS)
    core.ledger.barrier.committed_through = 5  # replicas can have applied steps up to 5
    stage0 = [p for p in ("a", "b", "c", "d", "e", "f") if join(core, p) == 0]
    honest, liar = stage0[:2], stage0[2]
    for p in honest:
        core.handle(p, cm.Heartbeat(state="training", step=5, param_hash="H"), 0.5)
    core.handle(liar, cm.Heartbeat(state="training", step=5, param_hash="X"), 0.5)
    st = core.handle("x", cm.StatusRequest(), 0.6)
    assert st.stages[0].hashes_agree and st.stages[0].param_step == 5
    assert "hash-mismatch" in next(n for n in st.nodes if n.peer_id == liar).flags
    reply = core.handle("x", cm.StageHashesRequest(stage=0), 0.6)
    reported = [(ph.peer_id, ph.step, ph.hash) for ph in reply.param_hashes]
    assert len(reported) == 3 and majority_state((s, h) for _, s, h in reported) == (5, "H") and reply.step == 6
    # A joiner takes an honest donor's state and refuses the liar's.
    assert judge_state(6, "H", reported, frontier=6, init_hash="I")[0] == "ok"
    assert judge_state(6, "X", reported, frontier=6, init_hash="I")[0] == "refuse"


def test_a_claimed_step_of_2_62_is_not_recorded_and_no_stale_maximum_sticks() -> None:
    core = make_core(run_info(2), SETTINGS)
    core.ledger.barrier.committed_through = 5  # frontier 6: no replica has applied step 6 or later
    a, b = "a", "b"
    join(core, a), join(core, "s1"), join(core, b)
    core.handle(a, cm.Heartbeat(state="training", step=5, param_hash="H"), 0.5)
    core.handle(b, cm.Heartbeat(state="training", step=2**62 - 1, param_hash="X"), 0.5)
    m = core.registry.members[b]
    assert (m.step, m.param_hash) == (-1, "")
    st = core.handle("x", cm.StatusRequest(), 0.6)
    assert st.stages[0].param_step == 5 and "behind" not in next(n for n in st.nodes if n.peer_id == a).flags
    core.handle(b, cm.Heartbeat(state="training", step=6, param_hash="X"), 0.7)  # the open frontier itself
    assert m.step == -1
    # The latest report counts, down as well as up: a claim once made does not stay.
    core.handle(b, cm.Heartbeat(state="training", step=5, param_hash="H"), 0.8)
    core.handle(b, cm.Heartbeat(state="training", step=3, param_hash="old"), 0.9)
    assert (m.step, m.param_hash) == (3, "old")


def test_200_state_flips_in_0_8_s_bump_the_view_version_a_bounded_number_of_times() -> None:
    core = make_core(run_info(2), SETTINGS)
    join(core, "liar"), join(core, "watcher")
    core.handle("liar", cm.Heartbeat(state="training"), 0.1)
    watcher = core.handle("watcher", cm.Heartbeat(state="training"), 0.1).view_version
    version = core.registry.view_version
    pushes = 0
    now = 1.0
    for k in range(200):
        now += 0.004
        core.handle("liar", cm.Heartbeat(state="syncing" if k % 2 == 0 else "training"), now)
        reply = core.handle("watcher", cm.Heartbeat(state="training", view_version=watcher), now)
        pushes += reply.view_changed
        watcher = reply.view_version
    interval = SETTINGS.view_state_interval_s
    assert core.registry.view_version - version <= 1 + int(0.8 / interval)  # was 200
    assert pushes <= 1 + int(0.8 / interval)
    # The state it holds shows once the interval has passed: the view is late, never wrong for long.
    core.handle("liar", cm.Heartbeat(state="syncing"), now + interval)
    assert core.registry.view.get("liar").state == "syncing"
    assert core.registry.working(core.registry.members["liar"].stage) == 0


def test_a_corpus_check_from_stage_1_does_not_set_the_fingerprint() -> None:
    core = make_core(run_info(2), SETTINGS)
    s0, s1 = "a", "b"
    assert (join(core, s0), join(core, s1)) == (0, 1)
    assert refused(core, s1, cm.CorpusCheck(fingerprint="evil")) == "corpus_pending"
    assert core.corpus is None
    assert core.handle(s0, cm.CorpusCheck(fingerprint="good"), 1.0).first
    assert refused(core, s1, cm.CorpusCheck(fingerprint="evil")) == "corpus_mismatch"
    assert core.handle(s1, cm.CorpusCheck(fingerprint="good"), 1.0).fingerprint == "good"
    assert core.corpus == "good"


def test_a_lone_first_corpus_claimer_in_stage_0_is_outvoted_by_the_honest_replicas() -> None:
    core = make_core(run_info(2), SETTINGS)
    stage0 = [p for p in ("liar", "s1a", "h1", "s1b", "h2") if join(core, p) == 0]
    assert stage0 == ["liar", "h1", "h2"]
    assert core.handle("liar", cm.CorpusCheck(fingerprint="evil"), 1.0).first and core.corpus == "evil"
    # One against one: no majority yet, so the honest node waits rather than being refused for good.
    assert refused(core, "h1", cm.CorpusCheck(fingerprint="good")) == "corpus_disputed"
    assert core.handle("h2", cm.CorpusCheck(fingerprint="good"), 1.1).fingerprint == "good"
    assert core.corpus == "good" and core.drain().corpus == "good"  # persisted
    assert core.handle("h1", cm.CorpusCheck(fingerprint="good"), 1.2).fingerprint == "good"
    assert refused(core, "liar", cm.CorpusCheck(fingerprint="evil")) == "corpus_mismatch"
    # A departed voter no longer counts: its stage-0 successors decide.
    core.handle("h2", cm.Leave(), 1.3)
    assert core.registry.corpus_votes("good") == 1 and core.registry.corpus_votes("evil") == 1


# -- attack 8: block joins with a big view ---------------------------------------------------------


def _sybil(i: int, stage: int) -> Member:
    """The largest entry a member can have: the longest peer ID and the most, longest addresses."""
    addrs = [f"/dns4/{k}.".ljust(cm.MAX_ADDR, "h") for k in range(cm.MAX_ADDRS)]
    return Member(peer_id=f"{i:07d}".ljust(MAX_PEER_ID, "x"), addrs=addrs, device="cpu", memory_gb=1.0, throughput=100.0,
                  stage=stage, joined_at=0.0, last_seen=0.0, state="training", serving=stage, step=3, param_hash="p" * MAX_HASH)


def test_the_longest_addresses_a_join_may_carry_are_few_and_short() -> None:
    with pytest.raises(ValueError):
        cm.Join(addrs=ADDR * (cm.MAX_ADDRS + 1))
    with pytest.raises(ValueError):
        cm.Join(addrs=["/dns4/" + "h" * cm.MAX_ADDR])
    # 256: a relayed node advertises a circuit address (relay address + /p2p-circuit/p2p/<its id>, ~170 characters).
    assert (cm.MAX_ADDRS, cm.MAX_ADDR) == (4, 256)


def test_100000_members_keep_every_reply_under_the_frame_cap() -> None:
    num_stages, n = 4, 100_000
    core = make_core(run_info(num_stages), SETTINGS)
    core.ledger.barrier.committed_through = 3
    core.restore(members=[_sybil(i, i % num_stages) for i in range(n)], step=4, tickets=[], closed=[], history=[], bans=[], now=0.0)
    sizes: dict[str, int] = {}
    t0 = time.perf_counter()
    join_reply = core.handle("newcomer", cm.Join(addrs=ADDR), 1.0)
    sizes["JoinReply"] = len(encode(join_reply))
    assert len(join_reply.members) <= VIEW_MAX
    for delta in (False, True):
        reply = core.handle(f"{'' if delta else 'not'}delta-node", cm.Join(addrs=ADDR), 1.0)
        beat = core.handle(f"{'' if delta else 'not'}delta-node", cm.Heartbeat(state="training", view_delta=delta), 1.5)
        assert beat.view_changed and len(beat.members) <= VIEW_MAX and reply.view_version
        sizes[f"HeartbeatReply(delta={delta})"] = len(encode(beat))
    sizes["Members"] = len(encode(core.handle("operator", cm.MembersRequest(), 2.0)))
    sizes["StageHashes"] = len(encode(core.handle("operator", cm.StageHashesRequest(stage=0), 2.0)))
    status = core.handle("operator", cm.StatusRequest(), 2.0)
    sizes["Status"] = len(encode(status))
    assert sum(s.replicas for s in status.stages) == n + 3 and len(status.nodes) < n  # cut, and says so
    print(f"\nreply sizes at {n} members ({time.perf_counter() - t0:.1f} s):", sizes)
    assert max(sizes.values()) < FRAME_CAP / 4, sizes


def test_a_delta_that_would_carry_more_than_the_view_bound_is_sent_as_a_snapshot() -> None:
    core = make_core(run_info(2), SETTINGS)
    join(core, "node")
    version = core.handle("node", cm.Heartbeat(state="training", view_delta=True), 0.5).view_version
    for k in range(VIEW_MAX + 100):
        join(core, f"j{k}", 1.0)
    reply = core.handle("node", cm.Heartbeat(state="training", view_version=version, view_delta=True), 2.0)
    assert reply.view_changed and not reply.view_delta and len(reply.members) <= VIEW_MAX


def test_a_join_that_cannot_be_answered_is_not_registered_and_its_retry_works(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(run_info(2), SETTINGS)
    for k in range(20):
        join(core, f"m{k}")
    join(core, "back")
    core.handle("back", cm.Leave(), 0.5)
    live, version = core.registry.num_live, core.registry.view_version
    monkeypatch.setattr(cm, "MAX_REPLY_BYTES", 2_000)  # as if the view had outgrown the frame cap
    assert refused(core, "new", cm.Join(addrs=ADDR)) == "reply_too_large"
    assert "new" not in core.registry.members and core.registry.num_live == live
    assert core.registry.view.get("new") is None and core.registry.view_version > version  # nodes drop it too
    assert refused(core, "back", cm.Join(addrs=ADDR)) == "reply_too_large"
    assert core.registry.members["back"].status != "live" and core.registry.num_live == live
    monkeypatch.undo()
    assert join(core, "new", 2.0) in (0, 1)  # not `already_joined`
    assert core.registry.is_live("new") and core.registry.num_live == live + 1
    reply = core.handle("back", cm.Join(addrs=ADDR), 2.0)
    assert reply.rejoined and core.registry.num_live == live + 2


def test_an_expired_member_whose_rejoin_fails_keeps_its_old_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(run_info(2), SETTINGS)
    join(core, "a"), join(core, "b")
    core.handle("a", cm.Heartbeat(state="training"), 2.5)
    core.housekeeping(4.0)
    assert core.registry.members["b"].status == EXPIRED
    monkeypatch.setattr(cm, "MAX_REPLY_BYTES", 100)
    assert refused(core, "b", cm.Join(addrs=ADDR), 4.5) == "reply_too_large"
    assert core.registry.members["b"].status == EXPIRED and core.registry.members["b"].stage == 1


# -- attack 10: poison a joiner's state (the rule; tests/integration/test_state_sync.py runs it) -----


def test_a_joiner_accepts_only_the_majority_state_for_the_frontier() -> None:
    reported = [("p", 6, "H"), ("q", 6, "H"), ("r", 6, "X")]
    assert judge_state(7, "H", reported, frontier=7, init_hash="I")[0] == "ok"
    assert judge_state(7, "X", reported, frontier=7, init_hash="I")[0] == "refuse"  # the lying donor
    verdict, why = judge_state(8, "Y", reported, frontier=7, init_hash="I")
    assert verdict == "refuse" and "frontier" in why  # a step nobody could have applied
    # A liar alone on an old step is no majority of anything: the joiner waits, then downloads again...
    assert judge_state(5, "Z", [("p", 6, "H"), ("q", 6, "H"), ("r", 4, "Z")], frontier=7, init_hash="I")[0] == "wait"
    # ...and a step further back than the replicas' hash history is refused at once.
    assert judge_state(5, "Z", [("p", 14, "H"), ("q", 14, "H"), ("r", 4, "Z")], frontier=15, init_hash="I")[0] == "refuse"


def test_a_donors_snapshot_a_few_steps_behind_its_latest_report_is_checked_against_its_history() -> None:
    """The donor trains on while a joiner downloads: its snapshot (after step 22) is behind its latest
    heartbeat (after step 24), which also carries its hashes after steps 17..24. Before the history,
    a joiner of a one-donor stage refused every snapshot as "older than most replicas'" and never synced."""
    core = make_core(run_info(2), SETTINGS)
    core.ledger.barrier.committed_through = 24
    donor = next(p for p in ("a", "b", "c") if join(core, p) == 0)
    recent = [cm.RecentHash(step=s, hash=f"H{s}") for s in range(17, 25)]
    core.handle(donor, cm.Heartbeat(state="training", step=24, param_hash="H24", recent=recent), 0.5)
    reply = core.handle("x", cm.StageHashesRequest(stage=0), 0.6)
    reported = [(ph.peer_id, ph.step, ph.hash) for ph in reply.param_hashes]
    assert [s for _, s, _ in reported] == list(range(17, 25))
    assert judge_state(23, "H22", reported, frontier=25, init_hash="I")[0] == "ok"
    assert judge_state(23, "X", reported, frontier=25, init_hash="I")[0] == "refuse"
    # Steps at or past the frontier are not recorded, even inside the history.
    core.handle(donor, cm.Heartbeat(state="training", step=24, param_hash="H24", recent=(recent + [cm.RecentHash(step=30, hash="F")])[-8:]), 0.7)
    reply = core.handle("x", cm.StageHashesRequest(stage=0), 0.8)
    assert max(ph.step for ph in reply.param_hashes) == 24


def test_a_liars_made_up_history_is_one_vote_among_the_stages_replicas() -> None:
    honest = [(p, s, f"H{s}") for p in ("p", "q") for s in range(20, 25)]
    liar = [("r", s, f"X{s}") for s in range(20, 25)]
    assert judge_state(23, "H22", honest + liar, frontier=25, init_hash="I")[0] == "ok"
    assert judge_state(23, "X22", honest + liar, frontier=25, init_hash="I")[0] == "refuse"
    # A replica that joined after the step does not hold it: with it, one reporter of two is no majority.
    assert judge_state(21, "H20", [("p", 20, "H20"), ("p", 21, "H21"), ("q", 21, "H21")], frontier=25, init_hash="I")[0] == "wait"


def test_with_no_hash_to_compare_a_joiner_waits_and_never_installs() -> None:
    assert judge_state(7, "H", [], frontier=7, init_hash="I")[0] == "wait"  # the hashes request failed
    assert judge_state(7, "H", [("p", 5, "G"), ("q", 5, "G")], frontier=7, init_hash="I")[0] == "wait"  # not reported yet
    assert judge_state(7, "H", [("p", 6, "H"), ("q", 6, "X")], frontier=7, init_hash="I")[0] == "wait"  # split: no majority


def test_a_single_replica_is_its_stages_majority_and_step_0_is_the_init() -> None:
    # One replica, one reporter: a majority of one is all a joiner can know there.
    assert judge_state(7, "H", [("p", 6, "H")], frontier=7, init_hash="I")[0] == "ok"
    # Before any step the state is the run seed's init, which the joiner built itself.
    assert judge_state(0, "I", [], frontier=0, init_hash="I")[0] == "ok"
    assert judge_state(0, "X", [], frontier=0, init_hash="I")[0] == "refuse"
