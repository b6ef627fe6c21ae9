"""Issue 12's ticket/commit attacks, run as an attacker would: hostile requests against the real cores.

Attack 3 (crash nodes with redo), attack 5 (commit a stage alone) and attack 6 (complete work it never
did, sit on leases). Each test drives a real :class:`CoordinatorCore` with a fake clock and real Ed25519
keys (the acks are real signatures), and, where the attack aimed at nodes, the real :class:`NodeCore`.
"""

from __future__ import annotations

import math

import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.errors import Refusal
from protolearn.node.core import events as ev
from protolearn.node.core.closed_step import CoreConfig, NodeCore, Phase
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.identity import Identity
from protolearn.protocol.rounds import REVISIONS_PER_STEP, round_id
from pydantic import ValidationError
from tests.support.coordinator import make_core, run_info

B = 8
VOCAB = 259
SETTINGS = CoordinatorSettings(
    heartbeat_interval_s=1.0, expiry_s=1e6, lease_s=10.0, lease_block=4, rate_per_s=1e6, rate_burst=1e6,
    rebalance_interval_s=1e9,
)


RUN = run_info(2, name="attacks", run_hash="ab" * 32, microbatches=B, vocab_size=VOCAB)


class Swarm:
    """Real identities joined to one core, each heartbeating as a training replica."""

    def __init__(self, core: CoordinatorCore, per_stage: int) -> None:
        self.core = core
        self.ids: dict[str, Identity] = {}
        self.stages: dict[int, list[str]] = {s: [] for s in range(core.run.num_stages)}
        while any(len(v) < per_stage for v in self.stages.values()):
            ident = Identity.generate()
            reply = core.handle(ident.peer_id, cm.Join(addrs=["/ip4/127.0.0.1/tcp/9"], throughput=100.0), 0.0)
            assert isinstance(reply, cm.JoinReply)
            self.ids[ident.peer_id] = ident
            self.stages[reply.stage].append(ident.peer_id)
            core.handle(ident.peer_id, cm.Heartbeat(state="training"), 0.0)

    def ack(self, signer: str, step: int, index: int, route: list[str], loss: float, nonce: bytes | None = None) -> bytes:
        """``signer``'s ack, over the ticket's current lease nonce unless ``nonce`` is given (what the lease reply gave)."""
        nonce = self.core.nonce(step, index) if nonce is None else nonce
        return self.ids[signer].sign(ack_statement(self.core.run.run_hash, step, index, route, loss, nonce))

    def complete(self, s0: str, step: int, index: int, route: list[str], loss: float, now: float) -> cm.CompleteReply:
        nonce = self.core.nonce(step, index)  # the ticket's current lease's, as its lease reply gave it
        msg = cm.Complete(step=step, index=index, route=route, loss=loss, ack=self.ack(route[-1], step, index, route, loss, nonce), nonce=nonce)
        reply = self.core.handle(s0, msg, now)
        assert isinstance(reply, cm.CompleteReply)
        return reply

    def close_step(self, now: float, *, s0: str | None = None, width: int | None = None) -> int:
        """Lease and complete every open ticket through one replica per stage (the first ``width`` of each
        later stage take part, all by default); returns the closed step."""
        s0 = s0 or self.stages[0][0]
        step = self.core.ledger.step
        while self.core.ledger.step == step:
            lease = self.core.handle(s0, cm.Lease(max_tickets=B), now)
            assert isinstance(lease, cm.LeaseReply) and lease.indices, lease.reason
            for i in lease.indices:
                # Spread the later hops over each stage's replicas, so every replica takes part in the step.
                route = [s0] + [self.stages[s][i % (width or len(self.stages[s]))] for s in range(1, self.core.run.num_stages)]
                self.complete(s0, step, i, route, 3.0, now)
        return step

    def averaged(self, peer: str, step: int, result_hash: str, now: float = 1.0) -> cm.StepInfo:
        revision = self.core.ledger.closed[step].revision
        reply = self.core.handle(peer, cm.Averaged(step=step, revision=revision, result_hash=result_hash), now)
        assert isinstance(reply, cm.StepInfo)
        return reply


def refused(code: str, fn, *args) -> Refusal:
    with pytest.raises(Refusal) as err:
        fn(*args)
    assert err.value.code == code, err.value
    return err.value


def node_core(me: str, *, applied: int = 0) -> NodeCore:
    core = NodeCore(me, 1, CoreConfig(microbatches_per_step=B, max_in_flight=4, max_deferred=4, averaging_timeout_s=30.0),
                    applied=applied)
    core.handle(ev.Synced(applied), 0.0)
    return core


# -- attack 3: a redo storm ------------------------------------------------------------------------
def test_a_redo_storm_is_capped_per_peer_and_flagged_and_never_overflows_the_round_id() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    attacker, honest = swarm.stages[1]
    granted, codes = 0, []
    now = 0.0
    step = swarm.close_step(now)
    for _ in range(48):  # the review's storm: 48 requests
        now += 0.1
        try:
            reply = core.handle(attacker, cm.Redo(step=step, indices=[0], reason="storm", revision=core.ledger.closed[step].revision), now)
        except Refusal as err:
            codes.append(err.code)
            continue
        granted += 1
        assert reply.reopened
        swarm.close_step(now)  # the honest swarm redoes the ticket and the step closes again
    revision = core.ledger.closed[step].revision
    assert granted == SETTINGS.max_redos_per_peer and revision == granted + 1
    assert set(codes) == {"redo_limit"}
    assert "redo_storm:1" in core.verdicts.flags_of(attacker)  # flagged once for the step, not banned
    assert not core.verdicts.is_banned(attacker)
    # The honest replica of the stage may still redo (e.g. a replica really died during averaging).
    reply = core.handle(honest, cm.Redo(step=step, indices=[1], reason="replica died", revision=revision), now)
    assert reply.reopened and core.verdicts.flags_of(honest) == []
    swarm.close_step(now)
    assert round_id(step, core.ledger.closed[step].revision) < round_id(step + 1)  # no overflow into the next step's rounds


def test_revisions_per_step_are_capped_however_many_peers_collude() -> None:
    settings = SETTINGS.model_copy(update={"max_revisions": 5, "max_redos_per_peer": 100})
    core = make_core(RUN, settings)
    swarm = Swarm(core, per_stage=3)
    step = swarm.close_step(0.0)
    codes = []
    for k in range(20):
        peer = swarm.stages[1][k % 3]
        try:
            core.handle(peer, cm.Redo(step=step, indices=[k % B], revision=core.ledger.closed[step].revision), 1.0 + k)
        except Refusal as err:
            codes.append(err.code)
            continue
        swarm.close_step(1.0 + k)
    assert core.ledger.closed[step].revision == settings.max_revisions < REVISIONS_PER_STEP
    assert codes and set(codes) == {"revision_cap"}
    # The last revision stands: it commits when the replicas report it.
    for s in (0, 1):
        for p in swarm.stages[s]:
            info = swarm.averaged(p, step, "h", 30.0)
    assert info.committed and info.revision == settings.max_revisions


def test_at_the_revision_cap_the_commit_waits_only_for_the_live_participants() -> None:
    """At the cap a dead participant's tickets cannot be redone: the survivors apply what their round has
    and serve no result, so a left-out replica could never report; the step commits without it."""
    settings = SETTINGS.model_copy(update={"max_revisions": 2})
    core = make_core(RUN, settings)
    swarm = Swarm(core, per_stage=3)
    a, b, left_out = swarm.stages[1]
    step = swarm.close_step(0.0, width=2)

    def report_participants(now: float) -> cm.StepInfo:
        for p in swarm.stages[0]:
            swarm.averaged(p, step, "h0", now)
        swarm.averaged(a, step, "h1", now)
        return swarm.averaged(b, step, "h1", now)

    assert not report_participants(1.0).committed  # below the cap every live replica must hold the result
    core.handle(a, cm.Redo(step=step, indices=[0], revision=1), 2.0)
    swarm.close_step(3.0, width=2)
    assert core.ledger.closed[step].revision == settings.max_revisions
    refused("revision_cap", core.handle, a, cm.Redo(step=step, indices=[1], revision=2), 3.5)
    assert report_participants(4.0).committed


@pytest.mark.parametrize("code", ["revision_cap", "redo_limit"])
def test_the_node_core_takes_a_capped_redo_as_a_refusal_and_never_raises(code: str) -> None:
    me, other = "me", "other"
    core = node_core(me)
    # The round left a dead replica out: the survivor asks to redo its tickets, and the cap refuses.
    core.handle(ev.Closed(0, 1, {me: [0, 1], other: [2, 3]}, 3.0, [0, 1]), 0.0)
    assert core.phase is Phase.AVERAGING
    out = core.handle(ev.RoundDone(0, 1, [other]), 0.1)
    assert any(isinstance(a, ev.Redo) for a in out)
    out = core.handle(ev.RedoAnswer(0, 1, granted=False, reason=f"{code}: no more"), 0.2)
    assert [type(a) for a in out] == [ev.AskReopened]
    out = core.handle(ev.ReopenAnswer(0, 1, reopened=False), 0.3)
    # The round already left the dead replica out: apply what it has, saying which tickets are lost.
    assert any(isinstance(a, ev.Emit) and a.event == "tickets_lost" for a in out)
    assert core.phase is Phase.COMMITTING


# -- attack 5: commit a stage alone ----------------------------------------------------------------
def test_a_lone_liar_cannot_commit_its_stage_and_cannot_block_the_honest_majority() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=3)
    step = swarm.close_step(0.0)
    liar, h1, h2 = swarm.stages[1]
    for p in swarm.stages[0]:
        assert not swarm.averaged(p, step, "good0").committed
    # The liar reports first, with a result nobody else holds: its word alone commits nothing.
    assert not swarm.averaged(liar, step, "bogus").committed
    assert not swarm.averaged(h1, step, "good1").committed  # 1 vs 1 of 3 live: no majority yet
    assert not core.ledger.committed(step)
    # The second honest replica makes the majority; the liar counted as having reported, so it cannot hold the step.
    assert swarm.averaged(h2, step, "good1").committed
    assert core.ledger.barrier.hashes == {0: "good0", 1: "good1"}
    # The liar's next poll is refused: its node resyncs instead of applying.
    err = refused("result_mismatch", swarm.averaged, liar, step, "bogus")
    assert "resync" in err.reason
    assert any(f.startswith("result_mismatch:") for f in core.verdicts.flags_of(liar))
    # An honest late report of the committed result is fine.
    assert swarm.averaged(h1, step, "good1").committed


def test_a_liar_reporting_after_the_majority_is_refused_at_once_and_the_step_commits_without_it() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=3)
    step = swarm.close_step(0.0)
    liar, h1, h2 = swarm.stages[0]
    for p in swarm.stages[1]:
        swarm.averaged(p, step, "good1")
    swarm.averaged(h1, step, "good0")
    swarm.averaged(h2, step, "good0")
    assert not core.ledger.committed(step)  # the liar is live and has not reported yet
    refused("result_mismatch", swarm.averaged, liar, step, "bogus")
    assert core.ledger.committed(step)  # its dissent counts as its report: the honest majority commits


def test_two_replicas_that_disagree_never_commit_on_either_word() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    step = swarm.close_step(0.0)
    for p in swarm.stages[0]:
        swarm.averaged(p, step, "good0")
    a, b = swarm.stages[1]
    swarm.averaged(a, step, "one")
    swarm.averaged(b, step, "other")
    assert not core.ledger.committed(step)
    assert "disagree" in core.ledger.try_commit(core.registry.serving).reason


def test_the_node_core_resyncs_when_its_result_is_refused() -> None:
    core = node_core("me")
    core.handle(ev.Closed(0, 1, {"me": [0, 1], "x": [2, 3]}, 3.0, [0, 1]), 0.0)
    out = core.handle(ev.RoundDone(0, 1, []), 0.1)
    assert [type(a) for a in out] == [ev.WaitCommit]
    out = core.handle(ev.CommitAnswer(0, 1, False, refused="stage 1's majority holds result abc, not def; resync"), 0.2)
    assert [type(a) for a in out] == [ev.Emit, ev.Resync]
    assert core.phase is Phase.RESYNCING and core.applied == 0


# -- attack 6: complete work it never did ------------------------------------------------------------
def test_a_completion_needs_the_last_stages_signed_ack_of_its_route_and_loss() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=1)
    s0, s1 = swarm.stages[0][0], swarm.stages[1][0]
    route = [s0, s1]
    lease = core.handle(s0, cm.Lease(max_tickets=4), 0.0)
    i, j, k, m = lease.indices
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=3.0), 0.1)  # missing
    forged = swarm.ack(s0, 0, i, route, 3.0)  # stage 0 signs for the honest hop: wrong key
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=forged), 0.1)
    other_loss = swarm.ack(s1, 0, i, route, 3.0)  # the hop's real ack, with the loss changed
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=0.5, ack=other_loss), 0.1)
    replayed = swarm.ack(s1, 0, j, route, 3.0)  # another ticket's ack
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=replayed), 0.1)
    assert core.ledger.remaining() == B
    for t in (i, j, k, m):
        assert swarm.complete(s0, 0, t, route, 3.0, 0.2).remaining >= 0
    assert core.ledger.remaining() == B - 4


# -- attack 10: ack replay ---------------------------------------------------------------------------
def test_an_ack_from_an_earlier_lease_never_completes_a_redone_or_reopened_ticket() -> None:
    """The review's replay: a stage-0 member re-leases a redone ticket and hands in the last stage's ack from
    the ticket's earlier attempt, same route and loss, without running anything. Each lease has its own
    nonce, which the ack must sign, so the old ack is refused; a real run of the new lease completes."""
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=1)
    s0, s1 = swarm.stages[0][0], swarm.stages[1][0]
    route = [s0, s1]

    def old_ack(index: int) -> tuple[bytes, bytes]:
        nonce = core.nonce(0, index)
        return swarm.ack(s1, 0, index, route, 3.0, nonce), nonce

    # Within the open step: ticket 0 is done, then stage 1 (which lost its gradients, say) asks to redo it.
    lease = core.handle(s0, cm.Lease(max_tickets=1), 0.0)
    (i,) = lease.indices
    assert lease.nonces == [core.nonce(0, i)] and len(lease.nonces[0]) == 16
    ack, nonce = old_ack(i)
    assert core.handle(s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=ack, nonce=nonce), 0.1).remaining == B - 1
    core.handle(s1, cm.Redo(step=0, indices=[i], reason="lost its gradients"), 0.2)
    again = core.handle(s0, cm.Lease(max_tickets=1), 0.3)
    assert again.indices == [i] and again.nonces != lease.nonces
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=ack, nonce=nonce), 0.4)
    # Naming the new nonce with the old signature is no better: the ack signs the nonce.
    refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=ack, nonce=again.nonces[0]), 0.4)
    assert core.ledger.remaining() == B
    kept = {i: old_ack(i)}
    assert core.handle(s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=kept[i][0], nonce=kept[i][1]), 0.5).remaining == B - 1

    # A reopened step: every ticket's ack of revision 1 is kept, the step reopens, and none of them counts again.
    while core.ledger.step == 0:
        for t in core.handle(s0, cm.Lease(max_tickets=B), 0.6).indices:
            kept[t] = old_ack(t)
            core.handle(s0, cm.Complete(step=0, index=t, route=route, loss=3.0, ack=kept[t][0], nonce=kept[t][1]), 0.6)
    assert sorted(kept) == list(range(B)) and core.ledger.closed[0].revision == 1
    assert core.handle(s1, cm.Redo(step=0, indices=list(range(B)), reason="a replica died", revision=1), 0.7).reopened
    leased: list[int] = []
    while len(leased) < B:
        leased += core.handle(s0, cm.Lease(max_tickets=B), 0.8).indices
    for t, (ack, nonce) in kept.items():
        refused("bad_ack", core.handle, s0, cm.Complete(step=0, index=t, route=route, loss=3.0, ack=ack, nonce=nonce), 0.9)
    assert core.ledger.step == 0 and core.ledger.remaining() == B
    for t in range(B):
        swarm.complete(s0, 0, t, route, 3.0, 1.0)
    assert core.ledger.step == 1 and core.ledger.closed[0].revision == 2


def test_a_late_completion_of_a_lease_re_issued_to_the_same_holder_still_counts() -> None:
    """A lease that ran out while its ticket was in flight, re-issued to the same holder: the first attempt's
    ack names the earlier nonce, and it is genuine work, so it counts (ACK_ATTEMPTS back)."""
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=1)
    s0, s1 = swarm.stages[0][0], swarm.stages[1][0]
    route = [s0, s1]
    first = core.handle(s0, cm.Lease(max_tickets=1), 0.0)
    (i,) = first.indices
    ack = swarm.ack(s1, 0, i, route, 3.0, first.nonces[0])
    later = SETTINGS.lease_s + 1.0
    reissued = core.handle(s0, cm.Lease(max_tickets=1), later)
    assert reissued.indices == [i] and reissued.nonces != first.nonces
    reply = core.handle(s0, cm.Complete(step=0, index=i, route=route, loss=3.0, ack=ack, nonce=first.nonces[0]), later + 0.1)
    assert reply.remaining == B - 1


def test_a_one_stage_run_needs_no_ack() -> None:
    core = make_core(run_info(1, name="attacks", run_hash="ab" * 32, microbatches=B, vocab_size=VOCAB), SETTINGS)
    swarm = Swarm(core, per_stage=1)
    s0 = swarm.stages[0][0]
    i = core.handle(s0, cm.Lease(max_tickets=1), 0.0).indices[0]
    reply = core.handle(s0, cm.Complete(step=0, index=i, route=[s0], loss=3.0), 0.1)
    assert isinstance(reply, cm.CompleteReply) and reply.remaining == B - 1


@pytest.mark.parametrize("loss", [1.7e308, 10 * math.log(VOCAB) + 1e-6, -1e-9, -5.0])
def test_an_implausible_loss_is_refused_even_with_a_colluding_last_stage(loss: float) -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=1)
    s0, s1 = swarm.stages[0][0], swarm.stages[1][0]
    i = core.handle(s0, cm.Lease(max_tickets=1), 0.0).indices[0]
    refused("bad_loss", swarm.complete, s0, 0, i, [s0, s1], loss, 0.1)
    assert core.ledger.remaining() == B and core.history.maxlen and not core.history
    swarm.complete(s0, 0, i, [s0, s1], 0.0, 0.2)  # the bounds themselves are plausible
    assert core.ledger.remaining() == B - 1


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_never_reaches_the_ledger(loss: float) -> None:
    with pytest.raises(ValidationError):
        cm.Complete(step=0, index=0, route=["a", "b"], loss=loss, ack=b"x")
    led = TicketLedger(4, 2, lease_s=10.0, block=4, max_loss=55.0)
    led.lease("a", 0.0, 4)
    d = led.complete("a", 0, 0, ["a", "b"], loss, 0.1)
    assert not d.accepted and d.code == "bad_loss"


def test_a_lease_sitter_loses_share_and_the_step_still_closes_within_one_lease_term() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=2)
    sitter, honest = swarm.stages[0]
    s1 = swarm.stages[1][0]
    lease_s = SETTINGS.lease_s

    def work(peer: str, now: float) -> list[int]:
        step = core.ledger.step
        got = core.handle(peer, cm.Lease(max_tickets=B), now).indices
        for i in got:
            swarm.complete(peer, step, i, [peer, s1], 3.0, now + 0.1)
        return got

    def commit(step: int, now: float) -> None:
        for s in (0, 1):
            for p in swarm.stages[s]:
                swarm.averaged(p, step, f"h{s}", now)
        assert core.ledger.committed(step)

    # Step 0: the sitter takes its share (B / 2 replicas) and sits on it; the honest replica works.
    assert len(core.handle(sitter, cm.Lease(max_tickets=B), 0.0).indices) == B // 2
    assert len(work(honest, 0.0)) == B // 2
    t = 0.0
    while core.ledger.step == 0:
        t += SETTINGS.housekeeping_interval_s
        assert t <= lease_s + 1.0, "the sat-on step did not close within one lease term"
        core.housekeeping(t)
        work(honest, t)  # expired leases are re-issued to whoever asks next
    assert core.verdicts.flags_of(sitter) == ["late_leases:1"] and not core.verdicts.flags_of(honest)
    commit(0, t)
    # Step 1: a struck sitter gets half its share, and sitting again halves it again, down to one ticket.
    assert len(core.handle(sitter, cm.Lease(max_tickets=B), t).indices) == B // 4
    work(honest, t)
    start = t
    while core.ledger.step == 1:
        t += SETTINGS.housekeeping_interval_s
        assert t - start <= lease_s + 1.0
        core.housekeeping(t)
        work(honest, t)
    commit(1, t)
    assert core.verdicts.flags_of(sitter) == ["late_leases:2"]
    assert len(core.handle(sitter, cm.Lease(max_tickets=B), t).indices) == 1
    # Completing on time again takes strikes off, one per ticket.
    i = core.ledger.holdings(sitter)[0]
    swarm.complete(sitter, 2, i, [sitter, s1], 3.0, t + 0.5)
    assert len(core.handle(sitter, cm.Lease(max_tickets=B), t + 0.5).indices) == B // 4


@pytest.mark.parametrize(("num_peers", "numel"), [(1, 5), (2, 7), (3, 50), (5, 3), (4, 1)])
def test_a_replica_that_fetched_the_result_reports_the_participants_result_hash(num_peers: int, numel: int) -> None:
    """The commit compares hashes: a left-out replica hashes its fetched vector exactly as the round did."""
    from protolearn.protocol.collective.result_proof import vector_digest as result_digest
    from tests.unit.test_collective import Net, make

    weights, vectors = make(num_peers, numel, seed=num_peers * 100 + numel)
    net = Net(weights, vectors, op="sum", seed=1)
    net.run()
    assert not net.failed and len(net.done) == num_peers
    for done in net.done.values():
        assert result_digest(done.result.clone(), len(weights)) == done.digest
    flipped = next(iter(net.done.values())).result.clone()
    flipped[0] += 1.0
    assert result_digest(flipped, len(weights)) != next(iter(net.done.values())).digest


def test_completing_one_ticket_of_a_block_does_not_buy_the_right_to_sit_on_the_rest() -> None:
    core = make_core(RUN, SETTINGS)
    swarm = Swarm(core, per_stage=1)
    sitter, s1 = swarm.stages[0][0], swarm.stages[1][0]
    lease = core.handle(sitter, cm.Lease(max_tickets=4), 0.0).indices
    swarm.complete(sitter, 0, lease[0], [sitter, s1], 3.0, 0.1)  # one quick completion, then nothing
    late_s = SETTINGS.lease_late_fraction * SETTINGS.lease_s
    core.housekeeping(late_s + 0.05)
    assert core.verdicts.flags_of(sitter) == []  # it made progress lately
    core.housekeeping(late_s + 0.2)
    assert core.verdicts.flags_of(sitter) == ["late_leases:1"]
    core.housekeeping(late_s + 1.0)
    assert core.verdicts.flags_of(sitter) == ["late_leases:1"]  # one strike per lease term


@pytest.mark.parametrize("seed", range(12))
def test_a_lying_replica_in_the_simulated_swarm_is_refused_and_resyncs_while_the_honest_ones_train(seed: int, tmp_path) -> None:
    """The node-core simulator's whole swarm (2 stages x 3 replicas, real coordinator and node cores) with
    one replica that reports a forged result hash for every step: every step still commits, the honest
    replicas apply every ticket of every step (I1) and agree (I2), and the liar only ever resyncs."""
    from tests.unit.node_sim import Sim

    sim = Sim(seed, tmp_path / "sim", stages=2, replicas=3, steps=4)
    liar = sim.rng.choice(sorted(sim.nodes))
    sim.liars.add(liar)
    sim.run_until_done()
    honest = [n for n in sim.nodes.values() if n.peer != liar]
    assert all(n.core.applied >= sim.steps for n in honest), [(n.peer, n.core.applied) for n in sim.nodes.values()]
    for n in honest:
        assert all(tickets == tuple(range(sim.B)) for tickets in n.params), f"I1: {n.peer}"
    for s in range(sim.S):
        replicas = [n for n in honest if n.stage == s]
        assert all(n.params[: sim.steps] == replicas[0].params[: sim.steps] for n in replicas), f"I2: stage {s}"
    decisions = set(sim.nodes[liar].decisions.values())
    assert "apply" not in decisions and "resync" in decisions
    assert any(f.startswith("result_mismatch:") for f in sim.coord.verdicts.flags_of(liar))
