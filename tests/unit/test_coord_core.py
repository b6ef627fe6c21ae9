"""The coordinator core end to end without IO: requests in, replies out, persisted and restored."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.status import STATUS_JSON_SCHEMA
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.store import Store
from protolearn.protocol import coordination as cm
from protolearn.protocol import statements
from protolearn.protocol.identity import Identity
from protolearn.stages.config import default_run
from tests.support.coordinator import STEP_SETTINGS, TEST_ACK, join, run_step
from tests.support.coordinator import default_core as make_core

SETTINGS = STEP_SETTINGS


def test_join_returns_the_run_and_a_stage() -> None:
    core = make_core()
    r = join(core, "a")
    assert r.run_hash == default_run().run_hash() and "[model]" in r.run_toml
    assert r.stage == 0 and [m.peer_id for m in r.members] == ["a"]
    assert join(core, "b").stage == 1
    with pytest.raises(Refusal) as err:
        join(core, "a")
    assert err.value.code == "already_joined"


def test_a_full_step_closes_with_accounting_and_mean_loss() -> None:
    core = make_core()
    join(core, "a"), join(core, "b")
    run_step(core, "a", "b", 1.0)
    info = core.step_info(0)
    assert info.closed and info.revision == 1 and info.loss == pytest.approx(2.0 + 1.5)
    assert [(a.stage, [(p.peer_id, p.tickets) for p in a.peers]) for a in info.accounting] == [
        (0, [("a", [0, 1, 2, 3])]),
        (1, [("b", [0, 1, 2, 3])]),
    ]
    assert not core.step_info(1).closed


def test_only_stage0_leases_and_routes_must_name_live_members_of_each_stage() -> None:
    core = make_core()
    join(core, "a"), join(core, "b")
    with pytest.raises(Refusal, match="not_stage0"):
        core.handle("b", cm.Lease(max_tickets=1), 0.0)
    i = core.handle("a", cm.Lease(max_tickets=1), 0.0).indices[0]
    with pytest.raises(Refusal, match="bad_route"):
        core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=["a", "ghost"], loss=1.0), 0.0)
    with pytest.raises(Refusal, match="not_leaseholder"):
        core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i + 1), step=0, index=i + 1, route=["a", "b"], loss=1.0), 0.0)


def test_leaving_member_frees_its_leases_and_the_tickets_routed_through_it() -> None:
    core = make_core()
    join(core, "a"), join(core, "b"), join(core, "c")  # c is a second stage-0 replica
    la = core.handle("a", cm.Lease(max_tickets=2), 0.0).indices
    lc = core.handle("c", cm.Lease(max_tickets=2), 0.0).indices
    core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, la[0]), step=0, index=la[0], route=["a", "b"], loss=1.0), 0.0)
    reply = core.handle("c", cm.Leave(reason="bye"), 1.0)
    assert reply.released == lc
    reply = core.handle("b", cm.Leave(), 1.0)
    assert reply.released == [la[0]]  # completed through b: b's gradients left with it
    assert core.ledger.remaining() == core.run.microbatches_per_step


def test_expiry_in_housekeeping_and_heartbeat_refused_after() -> None:
    core = make_core()
    join(core, "a"), join(core, "b")
    core.handle("a", cm.Heartbeat(state="training"), 2.0)
    events = core.housekeeping(3.5)
    assert any("expired peer=b" in e for e in events)
    with pytest.raises(Refusal, match="not_member"):
        core.handle("b", cm.Heartbeat(state="training"), 3.6)
    assert join(core, "b", 4.0).rejoined


def _equivocation(ident: Identity) -> tuple[cm.StatementEvidence, cm.StatementEvidence]:
    """Two fins of one collective round that ``ident`` signed with different result hashes."""
    round_dig = statements.round_digest(7, {ident.peer_id: 1.0, "x": 1.0}, 10, "sum")
    mask = statements.members_mask(sorted([ident.peer_id, "x"]), [ident.peer_id, "x"])
    a, b = (statements.fin_statement(round_dig, mask, bytes([k]) * 32) for k in (1, 2))
    return cm.StatementEvidence(data=a, signature=ident.sign(a)), cm.StatementEvidence(data=b, signature=ident.sign(b))


def test_one_member_cannot_ban_others_with_evidence_it_signed_itself() -> None:
    # The attack: evidence was checked against the *reporter's* key, so four requests banned four peers.
    core = make_core(SETTINGS.model_copy(update={"ban_on_evidence": True}))
    ids = [Identity.generate() for _ in range(5)]
    for ident in ids:
        join(core, ident.peer_id)
    attacker = ids[0]
    with pytest.raises(Refusal, match="unknown_peer"):
        core.handle(attacker.peer_id, cm.Report(target="nobody", reason="x"), 0.0)
    for victim in ids[1:]:
        own = cm.StatementEvidence(data=b"output digest", signature=attacker.sign(b"output digest"))
        for ev, other in ((own, None), (own, own)):
            with pytest.raises(Refusal, match="bad_evidence"):
                core.handle(attacker.peer_id, cm.Report(target=victim.peer_id, reason="x", evidence=ev, conflicting=other), 0.0)
        # Even two statements the victim really signed are no proof unless they contradict each other.
        honest = _equivocation(victim)[0]
        with pytest.raises(Refusal, match="do not contradict"):
            core.handle(attacker.peer_id, cm.Report(target=victim.peer_id, reason="x", evidence=honest, conflicting=honest), 0.0)
    assert not any(core.verdicts.is_banned(i.peer_id) for i in ids)


def test_a_proof_of_equivocation_bans_when_the_policy_allows_it() -> None:
    ids = [Identity.generate() for _ in range(4)]
    off = make_core()  # the default: a proof is recorded as a report, never a ban on its own
    on = make_core(SETTINGS.model_copy(update={"ban_on_evidence": True}))
    for core in (off, on):
        for ident in ids:
            join(core, ident.peer_id)
    bad = ids[3]
    a, b = _equivocation(bad)
    assert not off.handle(ids[0].peer_id, cm.Report(target=bad.peer_id, reason="two fins", evidence=a, conflicting=b), 1.0).banned
    reply = on.handle(ids[0].peer_id, cm.Report(target=bad.peer_id, reason="two fins", evidence=a, conflicting=b), 1.0)
    assert reply.banned
    hb = on.handle(ids[0].peer_id, cm.Heartbeat(state="training"), 1.5)
    assert hb.bans == [bad.peer_id] and bad.peer_id not in [m.peer_id for m in hb.members]
    for msg in (cm.Heartbeat(state="training"), cm.Join(addrs=[])):
        with pytest.raises(Refusal, match="banned"):
            on.handle(bad.peer_id, msg, 2.0)


def test_rate_limit_refuses_a_flood_but_not_others() -> None:
    core = make_core(CoordinatorSettings(rate_per_s=5, rate_burst=5))
    join(core, "a"), join(core, "b")
    with pytest.raises(Refusal, match="rate_limited"):
        for _ in range(10):
            core.handle("a", cm.Heartbeat(state="training"), 0.0)
    assert isinstance(core.handle("b", cm.Heartbeat(state="training"), 0.0), cm.HeartbeatReply)


def test_state_survives_a_store_round_trip(tmp_path: Path) -> None:
    core = make_core()
    store = Store(tmp_path)
    assert store.journal_mode() == "wal"
    join(core, "a"), join(core, "b"), join(core, "c")
    core.handle("a", cm.Heartbeat(state="training", step=0, param_hash="h0"), 0.5)
    run_step(core, "a", "b", 1.0)
    leased = core.handle("a", cm.Lease(max_tickets=2), 2.0).indices
    core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(1, leased[0]), step=1, index=leased[0], route=["a", "b"], loss=1.0), 2.0)
    core.ban("c", "operator", 2.0)
    store.apply(core.drain())
    store.close()

    again = make_core()
    again.restore(**Store(tmp_path).load(), now=100.0)
    assert again.ledger.step == 1
    assert {p: m.stage for p, m in again.registry.members.items()} == {"a": 0, "b": 1, "c": 0}
    assert sorted(m.peer_id for m in again.registry.live()) == ["a", "b"]
    assert again.ledger.holdings("a") == leased[1:]
    assert again.ledger.tickets[leased[0]].done
    assert again.verdicts.is_banned("c")
    assert again.step_info(0).loss == core.step_info(0).loss
    assert again.ledger.committed_through == 0 and again.step_info(0).committed
    # live members and leases got a fresh term: nothing expires right after the restart
    assert again.housekeeping(101.0) == []
    status = again.handle("x", cm.StatusRequest(), 101.0)
    jsonschema.validate(status.model_dump(mode="json"), STATUS_JSON_SCHEMA)


def test_wait_for_leases_nothing_until_that_many_nodes_joined_then_never_waits_again(tmp_path: Path) -> None:
    """``coordinator start --wait-for 3``: the first step's tickets wait for the third node, status says why; a member
    leaving later does not stop the run, and a restarted coordinator whose store holds a leased ticket has started."""
    settings = SETTINGS.model_copy(update={"start_members": 3})
    core = make_core(settings)
    join(core, "a"), join(core, "b")
    lease = core.handle("a", cm.Lease(max_tickets=4), 0.1)
    assert lease.indices == [] and "starts when 3 nodes have joined (2 so far" in lease.reason
    st = core.handle("x", cm.StatusRequest(), 0.1)
    assert st.verdict == "halted" and "starts when 3 nodes have joined" in st.verdict_reason
    join(core, "c")
    assert core.handle("a", cm.Lease(max_tickets=1), 0.2).indices, "the third node starts the run"
    core.handle("c", cm.Leave(), 0.3)
    assert core.handle("a", cm.Lease(max_tickets=1), 0.3).indices, "a departure after the start is churn, not a wait"
    assert "starts when" not in core.handle("x", cm.StatusRequest(), 0.3).verdict_reason

    store = Store(tmp_path)
    store.apply(core.drain())
    store.close()
    again = make_core(settings)
    again.restore(**Store(tmp_path).load(), now=10.0)
    assert again.handle("a", cm.Lease(max_tickets=4), 10.0).indices, "a store with leased tickets is a run that started"
    fresh = make_core(settings)
    fresh.restore(**Store(tmp_path / "empty").load(), now=10.0)
    join(fresh, "a"), join(fresh, "b")
    assert fresh.handle("a", cm.Lease(max_tickets=4), 10.0).indices == []


def test_status_verdicts() -> None:
    core = make_core()
    st = core.handle("x", cm.StatusRequest(), 0.0)
    assert st.verdict == "halted" and not st.healthy
    join(core, "a")
    st = core.handle("x", cm.StatusRequest(), 0.0)
    assert st.verdict == "halted" and "stage 1 has no replicas" in st.verdict_reason
    join(core, "b")
    run_step(core, "a", "b", 0.2)  # replicas report the steps they applied: only committed ones count
    for p, h in (("a", "h"), ("b", "h")):
        core.handle(p, cm.Heartbeat(state="training", step=0, param_hash=h), 0.5)
    st = core.handle("x", cm.StatusRequest(), 1.0)
    assert st.verdict == "healthy" and st.healthy, st.verdict_reason
    join(core, "c")  # stage 0 again, disagreeing hash: no majority of the two
    core.handle("c", cm.Heartbeat(state="training", step=0, param_hash="other"), 1.0)
    st = core.handle("x", cm.StatusRequest(), 1.0)
    assert st.verdict == "degraded" and "disagree" in st.verdict_reason
    assert "hash-mismatch" in next(n for n in st.nodes if n.peer_id == "c").flags
    st = core.handle("x", cm.StatusRequest(), 5.0)
    assert "stale" in st.nodes[0].flags
    jsonschema.validate(st.model_dump(mode="json"), STATUS_JSON_SCHEMA)


def test_redo_and_release_through_requests() -> None:
    core = make_core()
    join(core, "a"), join(core, "b")
    B = core.run.microbatches_per_step
    idx = core.handle("a", cm.Lease(max_tickets=B), 0.0).indices
    assert core.handle("a", cm.Release(step=0, indices=[idx[-1]]), 0.0).released == [idx[-1]]
    for i in idx[:-1]:
        core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=["a", "b"], loss=1.0), 0.0)
    # the stage-1 hop of ticket 0 lost its graph: b asks for a redo, and only tickets it touched
    reply = core.handle("b", cm.Redo(step=0, indices=[0], reason="backward hop failed"), 0.5)
    assert reply.indices == [0] and not reply.reopened and core.ledger.remaining() == 2
    join(core, "c", 0.5)  # a stranger to these tickets (stage 0)
    with pytest.raises(Refusal, match="redo_refused"):
        core.handle("c", cm.Redo(step=0, indices=[1]), 0.5)
    # finish the step, then drop b's contribution: the step reopens and closes again as revision 2
    for i in core.handle("a", cm.Lease(max_tickets=B), 1.0).indices:
        core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=["a", "b"], loss=1.0), 1.0)
    assert core.step_info(0).closed
    reply = core.handle("b", cm.Redo(step=0, indices=[2, 3], reason="contribution dropped"), 2.0)
    assert reply.reopened and reply.open_step == 0
    assert not core.step_info(0).closed
    for i in core.handle("a", cm.Lease(max_tickets=B), 3.0).indices:
        core.handle("a", cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=["a", "b"], loss=1.0), 3.0)
    info = core.step_info(0, min_revision=2)
    assert info.closed and info.revision == 2 and info.num_tickets == B


def four_members(core: CoordinatorCore) -> dict[int, list[str]]:
    by_stage: dict[int, list[str]] = {}
    for p in ("a", "b", "c", "d"):
        by_stage.setdefault(join(core, p).stage, []).append(p)
    assert sorted(len(v) for v in by_stage.values()) == [2, 2], by_stage
    return by_stage


def _close_through(core: CoordinatorCore, s0: str, alive: str, dead: str) -> None:
    """Close step 0 with stage 1's tickets split between ``alive`` (odd) and ``dead`` (even)."""
    B = core.run.microbatches_per_step
    while core.ledger.step == 0:
        for i in core.handle(s0, cm.Lease(max_tickets=B), 0.0).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=[s0, alive if i % 2 else dead], loss=1.0), 0.0)


def test_a_survivor_redoes_a_dead_replicas_tickets_even_after_another_stage_averaged() -> None:
    core = make_core()
    (s0, _), (alive, dead) = four_members(core).values()
    B = core.run.microbatches_per_step
    _close_through(core, s0, alive, dead)
    theirs = list(range(0, B, 2))
    # A stage-0 peer that averaged nothing of stage 1's share cannot redo it.
    with pytest.raises(Refusal, match="redo_refused"):
        core.handle(_other(core, s0), cm.Redo(step=0, indices=theirs), 0.5)
    # Stage 0 averaged in full, but stage 1 has not: nobody may apply yet, so the step can still reopen.
    info = core.handle(s0, cm.Averaged(step=0, revision=1), 0.5)
    assert info.closed and not info.committed
    assert core.handle(s0, cm.Lease(max_tickets=B), 0.5).indices == []  # step 1 waits for the commit
    reply = core.handle(alive, cm.Redo(step=0, indices=theirs, reason="replica out"), 0.7)
    assert reply.reopened and reply.indices == theirs and core.ledger.remaining() == len(theirs)


def test_a_step_commits_once_every_stage_averaged_it_and_then_never_reopens() -> None:
    core = make_core()
    (s0, _), (alive, dead) = four_members(core).values()
    B = core.run.microbatches_per_step
    _close_through(core, s0, alive, dead)
    with pytest.raises(Refusal, match="stale_revision"):
        core.handle(s0, cm.Averaged(step=0, revision=2), 0.5)
    assert not core.handle(s0, cm.Averaged(step=0, revision=1), 0.5).committed
    info = core.handle(alive, cm.Averaged(step=0, revision=1), 0.6)
    assert info.committed and core.step_info(0).committed and core.ledger.committed_through == 0
    with pytest.raises(Refusal) as err:
        core.handle(alive, cm.Redo(step=0, indices=[0], reason="too late"), 0.7)
    assert err.value.code == "step_committed" and core.ledger.step == 1
    assert core.handle(s0, cm.Lease(max_tickets=B), 0.8).indices  # step 1 is open for work
    assert core.drain().committed == 0  # and the commit is persisted


def test_when_every_participant_of_a_stage_is_gone_any_replica_of_it_may_redo_the_step() -> None:
    core = make_core()
    (s0, _), (alive, dead) = four_members(core).values()
    B = core.run.microbatches_per_step
    # Stage 1's share went entirely through `dead`; `alive` took no part.
    while core.ledger.step == 0:
        for i in core.handle(s0, cm.Lease(max_tickets=B), 0.0).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=[s0, dead], loss=1.0), 0.0)
    with pytest.raises(Refusal, match="redo_refused"):
        core.handle(alive, cm.Redo(step=0, indices=list(range(B))), 0.5)
    core.handle(dead, cm.Leave(reason="died"), 0.6)
    reply = core.handle(alive, cm.Redo(step=0, indices=list(range(B)), reason="nobody left who averaged stage 1"), 0.7)
    assert reply.reopened and core.ledger.remaining() == B


def _other(core: CoordinatorCore, peer: str) -> str:
    stage = core.registry.members[peer].stage
    return next(m.peer_id for m in core.registry.live() if m.stage == stage and m.peer_id != peer)


def test_a_disconnected_members_leases_end_after_the_grace_unless_it_reconnects() -> None:
    core = make_core(SETTINGS.model_copy(update={"disconnect_grace_s": 0.5, "expiry_s": 30.0}))
    (s0a, s0b), _ = four_members(core).values()
    held = core.handle(s0a, cm.Lease(max_tickets=2), 0.0).indices
    core.connection_changed(s0a, False, 1.0)
    core.connection_changed(s0a, True, 1.2)  # a blip: it came back within the grace
    core.housekeeping(2.0)
    assert core.handle(s0b, cm.Lease(max_tickets=4), 2.0).indices and core.ledger.holdings(s0a) == held
    core.handle(s0b, cm.Release(step=0, indices=core.ledger.holdings(s0b)), 2.0)
    core.connection_changed(s0a, False, 3.0)
    assert not any("disconnected" in e for e in core.housekeeping(3.2))
    events = core.housekeeping(3.6)
    assert any(f"disconnected peer={s0a}" in e for e in events)
    # Presumed dead, it is leased nothing, not even the tickets its own leases held (a request of its own that the
    # service still held would take them back: they would sit with a dead peer until it expired).
    dead = core.handle(s0a, cm.Lease(max_tickets=4), 3.65)
    assert dead.indices == [] and dead.held == [] and "no connection" in dead.reason
    # Long before lease_s (10 s): the other stage-0 replica gets the dead one's tickets first.
    lease = core.handle(s0b, cm.Lease(max_tickets=4), 3.7)
    assert set(held) <= set(lease.indices) and core.reissued == len(held)
    core.handle(s0b, cm.Release(step=0, indices=core.ledger.holdings(s0b)), 3.8)
    core.connection_changed(s0a, True, 3.9)  # it was alive after all: back, it leases again
    assert core.handle(s0a, cm.Lease(max_tickets=2), 3.9).indices


def test_a_replica_presumed_dead_has_its_done_tickets_of_the_open_step_redone_at_once() -> None:
    """Its gradients for them were in it alone. They used to be redone only after the step closed and its stage's
    round left it out (bench.py recovery, a kill late in a step: 0.5 s later); now when its grace ends, with its
    leases. A completion that arrives from it after all still counts for a ticket it held."""
    core = make_core(SETTINGS.model_copy(update={"disconnect_grace_s": 0.5, "expiry_s": 30.0}))
    (s0a, s0b), (s1, _) = four_members(core).values()
    held = core.handle(s0a, cm.Lease(max_tickets=2), 0.0).indices
    done = held[0]
    core.handle(s0a, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, done), step=0, index=done, route=[s0a, s1], loss=1.0), 0.1)
    assert core.ledger.tickets[done].done
    core.connection_changed(s0a, False, 1.0)
    events = core.housekeeping(1.6)
    assert any(f"disconnected peer={s0a}" in e and f"redone=[{done}]" in e for e in events)
    assert not core.ledger.tickets[done].done
    lease = core.handle(s0b, cm.Lease(max_tickets=4), 1.7)
    assert set(held) <= set(lease.indices)  # the held one and the done one, to the survivor at once


def test_the_first_corpus_fingerprint_is_the_swarms_and_a_different_one_is_refused(tmp_path: Path) -> None:
    core = make_core()
    join(core, "a"), join(core, "b")
    assert core.handle("a", cm.CorpusCheck(fingerprint="f" * 64), 0.0).first
    assert not core.handle("b", cm.CorpusCheck(fingerprint="f" * 64), 0.1).first
    with pytest.raises(Refusal) as err:
        core.handle("b", cm.CorpusCheck(fingerprint="e" * 64), 0.2)
    assert err.value.code == "corpus_mismatch" and "Python version" in err.value.reason
    store = Store(tmp_path)
    store.apply(core.drain())
    again = make_core()
    again.restore(**store.load(), now=1.0)
    assert again.corpus == "f" * 64  # a restarted coordinator still holds the swarm to it


def test_each_working_stage0_replica_holds_at_most_its_share_of_the_step() -> None:
    core = make_core()
    (a, b), (c, d) = four_members(core).values()
    B = core.run.microbatches_per_step
    for p in (a, b, c, d):
        core.handle(p, cm.Heartbeat(state="training"), 0.0)
    first = core.handle(a, cm.Lease(max_tickets=B), 0.1).indices
    assert len(first) == B // 2
    assert core.handle(a, cm.Lease(max_tickets=B), 0.1).indices == []  # a replica that asks later is not starved
    assert len(core.handle(b, cm.Lease(max_tickets=B), 0.2).indices) == B - B // 2
    core.handle(a, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, first[0]), step=0, index=first[0], route=[a, c], loss=1.0), 0.3)
    core.handle(b, cm.Release(step=0, indices=core.ledger.holdings(b)), 0.3)
    assert core.handle(a, cm.Lease(max_tickets=B), 0.4).indices  # with room in hand, a takes what is free


def test_a_moving_member_counts_at_its_new_stage_only_once_it_serves_it() -> None:
    core = make_core()
    core.ledger.barrier.committed_through = 9  # a run past step 9: the steps below are ones replicas can have applied
    (a, b), (c, d) = four_members(core).values()
    for p in (a, b, c, d):
        core.handle(p, cm.Heartbeat(state="training", step=3, param_hash="old", stage=core.registry.members[p].stage), 0.0)
    m = core.registry.members[c]
    m.stage, m.step, m.param_hash = 0, -1, ""  # what a rebalance does when it moves c from stage 1 to 0
    # Still finishing its old stage: its stage-1 hash must not be compared with stage 0's replicas.
    core.handle(c, cm.Heartbeat(state="training", step=4, param_hash="stage1-hash", stage=1), 0.1)
    assert (m.step, m.param_hash, m.serving) == (-1, "", 1)
    status = core.handle("x", cm.StatusRequest(), 0.2)
    assert all(ph.peer_id != c for s in status.stages for ph in s.param_hashes if ph.hash)
    # Nor does it take a share of stage 0's tickets yet.
    assert len(core.handle(a, cm.Lease(max_tickets=4), 0.3).indices) == 2
    core.handle(c, cm.Heartbeat(state="training", step=4, param_hash="stage0-hash", stage=0), 0.4)
    assert (m.step, m.param_hash, m.serving) == (4, "stage0-hash", 0)


def _train(core: CoordinatorCore, now: float) -> None:
    """Every member heartbeats as a training replica of its stage (so the commit waits for it)."""
    for m in list(core.registry.live()):
        core.handle(m.peer_id, cm.Heartbeat(state="training", stage=m.stage), now)


def test_the_commit_waits_until_every_live_replica_holds_the_result_so_no_stage_state_is_lost() -> None:
    # Stage 0's tickets all went through s0; its stage-mate was left out and must fetch the result. If
    # the step committed before that, and s0 died, stage 0's state after the step would exist nowhere.
    core = make_core()
    (s0, left_out), (alive, dead) = four_members(core).values()
    _train(core, 0.1)
    _close_through(core, s0, alive, dead)
    assert not core.handle(s0, cm.Averaged(step=0, revision=1), 0.5).committed
    assert not core.handle(alive, cm.Averaged(step=0, revision=1), 0.5).committed
    info = core.handle(dead, cm.Averaged(step=0, revision=1), 0.5)
    assert not info.committed, "the left-out stage-0 replica does not hold the result yet"
    assert core.handle(left_out, cm.Averaged(step=0, revision=1), 0.6).committed  # it fetched it


def test_a_replica_the_commit_waited_for_dies_and_housekeeping_commits_without_it() -> None:
    core = make_core()
    (s0, left_out), (alive, dead) = four_members(core).values()
    _train(core, 0.1)
    _close_through(core, s0, alive, dead)
    for peer in (s0, alive, dead):
        core.handle(peer, cm.Averaged(step=0, revision=1), 0.5)
    assert not core.ledger.committed(0)
    core.housekeeping(0.6)
    assert not core.ledger.committed(0)  # it is connected: the commit waits for its report
    # Its connection closes: it cannot report, so the commit waits for it no longer, not even for the
    # disconnect grace (that only delays ending its leases, in case it comes back).
    core.connection_changed(left_out, False, 0.7)
    assert core.ledger.committed(0) and core.drain().committed == 0


def test_a_holders_report_counts_for_its_stage_after_a_coordinator_restart(tmp_path: Path) -> None:
    # The only participant of stage 1 reported, the coordinator restarted (reports are not persisted),
    # and the participant died: the stage-mate that fetched the full result vouches for the stage.
    core = make_core()
    (s0, other0), (alive, dead) = four_members(core).values()
    B = core.run.microbatches_per_step
    while core.ledger.step == 0:
        for i in core.handle(s0, cm.Lease(max_tickets=B), 0.0).indices:
            core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(0, i), step=0, index=i, route=[s0, dead], loss=1.0), 0.0)
    store = Store(tmp_path)
    store.apply(core.drain())
    again = make_core()
    again.restore(**store.load(), now=1.0)
    again.handle(dead, cm.Leave(reason="died"), 1.1)
    assert not again.handle(s0, cm.Averaged(step=0, revision=1), 1.2).committed
    assert again.handle(alive, cm.Averaged(step=0, revision=1), 1.3).committed


def test_a_stage_s_hashes_are_answered_from_its_serving_replicas_only() -> None:
    core = make_core()
    core.ledger.barrier.committed_through = 9  # a run past step 9: the steps below are ones replicas can have applied
    (s0, other0), (s1, _) = four_members(core).values()
    core.handle(s0, cm.Heartbeat(state="training", stage=0, step=3, param_hash="aa"), 1.0)
    core.handle(other0, cm.Heartbeat(state="syncing", stage=0, step=1, param_hash="bb"), 1.0)
    core.handle(s1, cm.Heartbeat(state="training", stage=1, step=3, param_hash="cc"), 1.0)
    reply = core.handle(s1, cm.StageHashesRequest(stage=0), 1.1)
    assert isinstance(reply, cm.StageHashes)
    assert [(p.peer_id, p.step, p.hash) for p in reply.param_hashes] == [(s0, 3, "aa")]
    assert core.handle(s1, cm.StageHashesRequest(stage=1), 1.1).param_hashes[0].hash == "cc"


def test_a_run_that_drops_departures_refuses_the_redo_of_a_round_that_left_a_replica_out() -> None:
    """batch.departures = "drop": the survivors apply the step without the left-out replica's tickets (the node
    core's tickets_lost path) instead of reopening it for every stage."""
    from tests.support.coordinator import make_core as core_for
    from tests.support.coordinator import run_info

    core = core_for(run_info(2, departures="drop"), SETTINGS, verify=lambda p, d, s: True)
    for peer in ("a", "b", "c"):
        join(core, peer)
    stage1 = [p for p in ("b", "c") if core.registry.members[p].stage == 1] or ["b"]
    run_step(core, "a", stage1[0], 1.0, commit=False)
    with pytest.raises(Refusal) as err:
        core.handle("a", cm.Redo(step=0, indices=[0], reason="replica out", revision=1, kind="replica_out"), 2.0)
    assert err.value.code == "dropped"


def test_joiners_that_have_not_measured_yet_count_as_a_typical_member_and_split_over_the_stages() -> None:
    """Four equal nodes join a 2-stage run, the last two while the first two train: the first two have reported their
    throughput, the third has not yet when the fourth joins. Counted as nothing, the third left its stage the least
    loaded and the fourth joined it too (a 3 to 1 split, seen in CI); counted as the median claim, the fourth takes
    the other stage."""
    core = make_core()
    first = {join(core, p, throughput=0.0).stage: p for p in ("a", "b")}
    assert sorted(first) == [0, 1]
    # Stage 0's replica reports a little less than stage 1's, as a node that waited longer for the pipeline does.
    for stage, rate in ((0, 90.0), (1, 110.0)):
        hb = core.handle(first[stage], cm.Heartbeat(state="training", throughput=rate), 1.0)
        assert isinstance(hb, cm.HeartbeatReply), hb
    third = join(core, "c", 2.0, throughput=0.0)
    assert third.stage == 0  # the stage with less throughput
    fourth = join(core, "d", 2.1, throughput=0.0)
    assert fourth.stage == 1, fourth.reason
    assert [load.replicas for load in core.registry.loads()] == [2, 2]
