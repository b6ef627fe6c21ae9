"""The collective with robust aggregation and the reducer cross-check.

Rounds run on the in-memory network of ``test_collective`` (random delivery order, probes, a fake clock,
crashes), with real Ed25519 keys so that the evidence a checker keeps can be checked by a third party
with :func:`verify_reducer_fault` alone. A tampering owner must never make honest replicas finish with
different results, nor with its wrong part; the checker must hold evidence that verifies; forged or
altered evidence must be refused with a reason.
"""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch
from protolearn.protocol.collective import Aggregation, Bandwidth, CollectiveRound, Failed, Rejected
from protolearn.protocol.identity import Identity
from protolearn.protocol.reducer_check import ReducerFault, make_fault, peer_id_public_key, verify_reducer_fault
from protolearn.protocol.collective.robust import robust_reduce
from protolearn.protocol.statements import fin_statement, members_mask, part_hash, slice_statement, veto_digest, verify_ed25519
from protolearn.protocol.wire import decode, encode
from protolearn.stages.config import IntegrityConfig

from tests.unit.test_collective import KILL_POINTS, Net, expected, signed_fin

TRIMMED = Aggregation("trimmed_mean", trim_fraction=0.25)
CLIP = Aggregation("centered_clip", clip_tau=1.0, clip_iters=3)


@cache
def identities(num: int) -> tuple[Identity, ...]:
    return tuple(sorted((Identity.generate() for _ in range(num)), key=lambda i: i.peer_id))


def add_one(part: int, data: torch.Tensor) -> torch.Tensor:
    return data + 1.0


class CheckedNet(Net):
    """A Net of cross-checked rounds with Ed25519 keys; ``tamperers`` add 1 to every part they reduce. A
    replica that vetoed answers a late probe with its vetoing fin (as the adapter does), never with 'left'."""

    def __init__(self, num_peers: int, numel: int, *, seed: int, op: str = "sum", agg: Aggregation = Aggregation(),
                 tamperers: frozenset[int] = frozenset(), cross_check: bool = True, **kill) -> None:
        ids = identities(num_peers)
        gen = torch.Generator().manual_seed(seed)
        self.weights = {i.peer_id: float(k % 3 + 1) for k, i in enumerate(ids)}
        self.vectors = {i.peer_id: torch.randn(numel, generator=gen) for i in ids}
        victim = kill.pop("victim", None)
        super().__init__(self.weights, self.vectors, op=op, seed=seed, victim=None if victim is None else ids[victim].peer_id, **kill)
        self.tamperers = {ids[k].peer_id for k in tamperers}
        self.rounds = {
            i.peer_id: CollectiveRound(7, i.peer_id, self.weights, numel, op=op, floor_s=1.0, bandwidth=Bandwidth(1e9),
                                       aggregation=agg, cross_check=cross_check, sign=i.sign, verify=verify_ed25519,
                                       part_filter=add_one if i.peer_id in self.tamperers else None)
            for i in ids
        }

    def probe(self, src: str, dst: str, suspects: list[str]) -> None:
        veto = self.rounds[dst].veto
        if dst in self.dead or veto is None:
            return super().probe(src, dst, suspects)
        members, digest, signature, vetoed = veto
        self.handle(src, self.rounds[src].receive(dst, "fin", 0, None, contributors=list(members), signer=dst, digest=digest,
                                                  signature=signature, vetoed=vetoed, suspects=sorted(self.rounds[dst].suspects),
                                                  now=self.now))

    def honest(self) -> list[str]:
        return [p for p in self.weights if p not in self.tamperers and p not in self.dead]

    def exact(self, members: list[str], agg: Aggregation) -> torch.Tensor:
        r = next(iter(self.rounds.values()))
        return torch.cat([robust_reduce({p: v[a:b] for p, v in self.vectors.items()}, members, self.weights, r.op, b - a, agg)
                          for a, b in r.bounds])


def assert_agree(net: CheckedNet) -> tuple[list[str], list[str]]:
    """Honest survivors that finished Done hold one result; returns (done, failed) among them."""
    honest = net.honest()
    assert not [p for p in honest if p not in net.done and p not in net.failed], "every honest survivor finishes"
    done = [p for p in honest if p in net.done]
    for p in done[1:]:
        assert torch.equal(net.done[p].result, net.done[done[0]].result) and net.done[p].digest == net.done[done[0]].digest
    return done, [p for p in honest if p in net.failed]


@pytest.mark.parametrize("agg", [Aggregation(), TRIMMED, CLIP], ids=["mean", "trimmed", "clip"])
@pytest.mark.parametrize("num_peers", [3, 5])
@pytest.mark.parametrize("op", ["sum", "weighted_mean"])
def test_cross_checked_rounds_finish_identically_with_the_rule_applied_per_part(agg: Aggregation, num_peers: int, op: str) -> None:
    for seed in range(4):
        net = CheckedNet(num_peers, 29, seed=seed, agg=agg, op=op)
        net.run()
        done, failed = assert_agree(net)
        assert not failed and len(done) == num_peers and net.now == 0.0, "no fault: nobody waits for a deadline"
        first = net.done[done[0]]
        assert first.contributors == sorted(net.weights)
        assert torch.equal(first.result, net.exact(sorted(net.weights), agg)), "the rule's exact bytes, part by part"


def test_mean_without_cross_check_is_bit_identical_to_before_and_with_it_to_without() -> None:
    plain = CheckedNet(4, 33, seed=1, cross_check=False)
    plain.run()
    checked = CheckedNet(4, 33, seed=1)
    checked.run()
    p = next(iter(plain.weights))
    torch.testing.assert_close(plain.done[p].result.double(), expected(plain.weights, plain.vectors, sorted(plain.weights), "sum"),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(plain.done[p].result, checked.done[p].result)


@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_cross_checked_rounds_survive_a_crash_at_each_phase(kill_point: str) -> None:
    for seed in range(6):
        net = CheckedNet(4, 23, seed=seed, agg=TRIMMED, victim=seed % 4, kill_point=kill_point)
        net.run()
        done, failed = assert_agree(net)
        assert not failed, [net.failed[p].reason for p in failed]
        first = net.done[done[0]]
        assert set(first.excluded) <= net.dead
        assert torch.equal(first.result, net.exact(first.contributors, TRIMMED))


@pytest.mark.parametrize("num_peers", [3, 5])
@pytest.mark.parametrize("agg", [Aggregation(), TRIMMED], ids=["mean", "trimmed"])
def test_a_tampering_owner_is_vetoed_and_its_checker_holds_evidence_that_verifies(num_peers: int, agg: Aggregation) -> None:
    for seed in range(4):
        liar = seed % num_peers
        net = CheckedNet(num_peers, 31, seed=seed, agg=agg, tamperers=frozenset({liar}))
        net.run()
        done, failed = assert_agree(net)
        assert not done, "the wrong part is never committed: every honest replica fails the round"
        ids = identities(num_peers)
        checker = ids[(liar + 1) % num_peers].peer_id
        faults = net.failed[checker].reducer_faults
        assert faults and net.failed[checker].missing == [ids[liar].peer_id]
        integrity = IntegrityConfig(aggregation=agg.rule, trim_fraction=agg.trim_fraction)  # what the coordinator holds
        for fault in faults:
            assert verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=integrity)[0]
            ok, why = verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=agg)
            assert ok, why
            assert fault.reducer == ids[liar].peer_id and ids[liar].peer_id in why
            # What a node sends the coordinator: the wire encoding, decoded, verifies the same.
            again = decode(encode(fault), peer="test", expect=ReducerFault)
            assert verify_reducer_fault(again, peer_id_public_key, aggregation_cfg=agg)[0]
        others = [p for p in failed if p != checker]
        assert all("vetoed" in net.failed[p].reason for p in others), "the others fail on the checker's veto at once"
        assert net.now == 0.0, "nobody waits for a deadline"


def test_a_tampering_backup_that_takes_over_a_dead_owners_part_is_caught_by_the_next_one() -> None:
    # peer 0 dies before starting: peer 1 (a tamperer) owns part 0, peer 2 checks it.
    for seed in range(3):
        net = CheckedNet(4, 24, seed=seed, tamperers=frozenset({1}), victim=0, kill_point="before_start")
        net.run()
        done, _ = assert_agree(net)
        assert not done
        faults = [f for p in net.failed for f in net.failed[p].reducer_faults if p not in net.tamperers]
        assert faults and all(verify_reducer_fault(f, peer_id_public_key, aggregation_cfg=Aggregation())[0] for f in faults)


def test_the_evidence_is_refused_when_forged_altered_or_truncated() -> None:
    net = CheckedNet(3, 30, seed=2, tamperers=frozenset({0}))
    net.run()
    ids = identities(3)
    (fault,) = net.failed[ids[1].peer_id].reducer_faults
    keys = peer_id_public_key
    assert verify_reducer_fault(fault, keys, aggregation_cfg=Aggregation())[0]

    def refused(ev: ReducerFault, cfg: Aggregation = Aggregation(), public_key_of=keys) -> str:
        ok, why = verify_reducer_fault(ev, public_key_of, aggregation_cfg=cfg)
        assert not ok and why
        return why

    def with_slice(k: int, **change) -> ReducerFault:
        slices = list(fault.slices)
        slices[k] = slices[k].model_copy(update=change)
        return fault.model_copy(update={"slices": slices})

    flipped = bytearray(fault.slices[1].data)
    flipped[0] ^= 1
    assert "not signed by" in refused(with_slice(1, data=bytes(flipped))), "an altered slice"
    resigned = ids[1].sign(b"anything")
    assert "not signed by" in refused(with_slice(1, signature=resigned)), "a slice signed by someone else"
    assert "not signed by" in refused(fault.model_copy(update={"reducer": ids[1].peer_id})), "blamed on another signer"
    assert "not signed by" in refused(fault.model_copy(update={"round": fault.round + 1})), "another round"
    assert "not signed by" in refused(fault, CLIP), "another aggregation rule than the run's"
    assert "not signed by" in refused(fault, public_key_of=lambda peer: None), "unknown keys"
    assert "float32 values" in refused(with_slice(2, data=fault.slices[2].data[:-4])), "a truncated slice"
    assert "one slice per member" in refused(fault.model_copy(update={"slices": fault.slices[:-1]})), "a missing slice"
    assert "sorted" in refused(fault.model_copy(update={"participants": list(reversed(fault.participants))}))
    assert "out of range" in refused(fault.model_copy(update={"part": 7}))
    assert "32-byte" in refused(fault.model_copy(update={"digest": fault.digest[:8]}))
    # An honest part with its honest statement proves nothing: the part is the reduction.
    honest = CheckedNet(3, 30, seed=2)
    honest.run()
    r = honest.rounds[ids[0].peer_id]
    p = r._ledger.counted(0, frozenset(honest.weights))
    slices = [(q, honest.rounds[ids[1].peer_id]._slices[0][q], honest.rounds[ids[1].peer_id]._cross.proofs[0][q][1]) for q in sorted(honest.weights)]
    clean = make_fault(7, honest.weights, 30, "sum", 0, sorted(honest.weights), p.signer, p.inputs, p.digest, p.signature, slices)
    assert "no fault" in refused(clean)
    # The accuser cannot swap in a slice of its own that differs from the one the reducer got, even signed.
    own = ids[1]
    data = torch.frombuffer(bytearray(fault.slices[1].data), dtype=torch.float32) + 5.0
    rd = net.rounds[own.peer_id]._round_digest
    swapped = with_slice(1, data=data.numpy().tobytes(), signature=own.sign(slice_statement(rd, fault.part, part_hash(data))))
    assert "not the ones" in refused(swapped)


def test_evidence_size_for_a_part_of_n_floats() -> None:
    net = CheckedNet(3, 3000, seed=0, tamperers=frozenset({2}))
    net.run()
    (fault,) = [f for p in net.failed for f in net.failed[p].reducer_faults]
    size = len(encode(fault))
    part = 1000
    assert 3 * 4 * part < size < 3 * (4 * part + 200) + 3 * 100 + 400, size


def test_a_veto_reaches_a_replica_that_already_holds_every_part() -> None:
    # Deliveries in any order: whoever got the wrong part first, no honest replica finishes Done with it.
    rng = random.Random(0)
    for seed in range(12):
        n = rng.choice([3, 4, 5])
        net = CheckedNet(n, rng.randint(n, 40), seed=seed, op=rng.choice(["sum", "weighted_mean"]), tamperers=frozenset({rng.randrange(n)}))
        net.run()
        done, failed = assert_agree(net)
        assert not done and failed


def test_the_evidence_bounds_match_the_collective() -> None:
    # (That the evidence message decodes without torch: tests/integration/test_purity.py.)
    from protolearn.protocol.collective import MAX_PARTICIPANTS
    from protolearn.protocol.collective.ownership import part_bounds
    from protolearn.protocol.reducer_check import MAX_PARTICIPANTS as FAULT_MAX, _part_bounds

    assert FAULT_MAX == MAX_PARTICIPANTS
    assert all(_part_bounds(numel, n, j) == part_bounds(numel, n)[j] for numel in range(12) for n in range(1, 6) for j in range(n))


@pytest.fixture
def cross_checked_schedules(monkeypatch: pytest.MonkeyPatch):
    """The seeded Byzantine schedules of ``test_collective``, with every round cross-checked."""
    import tests.unit.test_collective as tc

    plain = tc.make_round
    monkeypatch.setattr(tc, "make_round", lambda *a, **kw: plain(*a, cross_check=True, **kw))

    class CheckedForgingRound(CollectiveRound):
        """ForgingRound's lie (its own parts + 1, signed and committed), told through the tamper hook so that
        its statements carry the inputs digest a cross-checked round requires."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, cross_check=True, part_filter=add_one, **kw)

    monkeypatch.setattr(tc, "ForgingRound", CheckedForgingRound)
    return tc


def test_honest_survivors_agree_or_fail_in_the_byzantine_schedules_with_the_cross_check(cross_checked_schedules) -> None:
    tc = cross_checked_schedules
    outcomes: dict[str, int] = {}
    for seed in range(1040, 1240):  # 200 schedules beyond the ones test_collective runs
        net, weights, vectors, desc, liars = tc.byzantine_schedule(seed)
        net.run()
        outcome = tc.check_honest_agree(net, weights, vectors, desc, liars)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("done", 0) > 30 and outcomes.get("failed", 0) + outcomes.get("split", 0) > 30, outcomes


def test_a_consistent_forging_owner_is_detected_with_the_cross_check(cross_checked_schedules) -> None:
    # test_collective's documented limit, lifted: the backup now holds the slices and recomputes the part.
    tc = cross_checked_schedules
    weights, vectors = tc.make(4, 20, 3)
    net = tc.ByzNet(weights, vectors, op="sum", seed=3, liars={"peer02": {"forge_part"}}, max_liars=1)
    net.run()
    honest = ["peer00", "peer01", "peer03"]
    assert not [p for p in honest if p in net.done], "nobody commits the forged part"
    (fault,) = net.failed["peer03"].reducer_faults  # peer03 follows peer02 in part 2's chain
    assert fault.reducer == "peer02" and fault.part == 2 and net.failed["peer03"].missing == ["peer02"]


def test_a_veto_must_hash_to_the_statement_it_carries() -> None:
    ids = identities(3)
    net = CheckedNet(3, 9, seed=0)
    r, liar = net.rounds[ids[0].peer_id], ids[1]
    r.start(net.vectors[ids[0].peer_id], now=0.0)
    members = sorted(net.weights)
    statement = r._ledger.statement(1, members, bytes(32), bytes(32))
    kw = signed_fin(r, liar.peer_id, members, bytes(32))
    kw["signature"] = liar.sign(fin_statement(r._round_digest, members_mask(r.peers, members), bytes(32)))
    (out,) = r.receive(liar.peer_id, "fin", 0, None, vetoed=statement, **kw)
    assert isinstance(out, Rejected) and "veto digest" in out.reason and r.finished is None
    digest = veto_digest(statement)
    sig = liar.sign(fin_statement(r._round_digest, members_mask(r.peers, members), digest))
    (out,) = r.receive(liar.peer_id, "fin", 0, None, vetoed=statement, **{**kw, "digest": digest, "signature": sig})
    assert isinstance(out, Failed) and "vetoed" in out.reason and out.missing == [liar.peer_id]
