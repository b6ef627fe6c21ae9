"""The fault-tolerant collective state machine: N replicas exchanging parts in memory.

A small simulated network delivers messages in a random order, answers probes, advances a fake
clock to the next deadline when nothing is in flight, and kills one replica at a chosen point
(before it starts, mid-scatter, as a reducer holding its parts, mid-gather, after it committed, or
after any number of deliveries). Every survivor must finish with bit-identical results equal to the
reduction over exactly the contributors :class:`Done` reports.
"""

from __future__ import annotations

import hashlib
import hmac
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.protocol.collective import (
    Bandwidth,
    CollectiveRound,
    Done,
    Failed,
    Probe,
    Rejected,
    Send,
)
from protolearn.protocol.statements import fin_statement, members_mask, part_hash, part_statement

KILL_POINTS = ["before_start", "mid_scatter", "holding_parts", "mid_gather", "after_commit"]


def fake_sign(peer: str):
    """A keyed hash stands in for Ed25519 here: only code holding ``peer``'s name signs as it, and it is fast."""
    return lambda data: hashlib.blake2b(data, key=peer.encode()[:64], digest_size=64).digest()


def fake_verify(peer: str, data: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(fake_sign(peer)(data), signature)


def make_round(round_id: int, me: str, weights: dict[str, float], numel: int, **kw) -> CollectiveRound:
    return CollectiveRound(round_id, me, weights, numel, sign=fake_sign(me), verify=fake_verify, **kw)


def signed_part(r: CollectiveRound, signer: str, part: int, members, data: torch.Tensor) -> dict:
    """The keyword arguments of a gather of ``data`` as ``signer`` signs it, for ``r.receive``."""
    digest = part_hash(data)
    sig = fake_sign(signer)(part_statement(r._round_digest, part, members_mask(r.peers, members), digest))
    return {"contributors": sorted(members), "signer": signer, "digest": digest, "signature": sig}


def signed_fin(r: CollectiveRound, signer: str, members, digest: bytes) -> dict:
    sig = fake_sign(signer)(fin_statement(r._round_digest, members_mask(r.peers, members), digest))
    return {"contributors": sorted(members), "signer": signer, "digest": digest, "signature": sig}


class Net:
    """In-memory delivery among CollectiveRounds with one optional victim."""

    def __init__(self, weights: dict[str, float], vectors: dict[str, torch.Tensor], *, op: str, seed: int,
                 victim: str | None = None, kill_point: str | None = None, kill_after: int | None = None) -> None:
        self.rng = random.Random(seed)
        numel = next(iter(vectors.values())).numel()
        self.vectors = vectors
        self.rounds = {p: make_round(7, p, weights, numel, op=op, floor_s=1.0, bandwidth=Bandwidth(1e9)) for p in weights}
        self.now = 0.0
        self.inflight: list[tuple[str, Send, list[str]]] = []
        self.dead: set[str] = set()
        self.done: dict[str, Done] = {}
        self.failed: dict[str, Failed] = {}
        self.rejected: list[tuple[str, Rejected]] = []
        self.victim, self.kill_point, self.kill_after = victim, kill_point, kill_after
        self.deliveries = 0

    def kill(self, p: str) -> None:
        self.dead.add(p)
        # What p had in flight when it died arrives or not, at random.
        self.inflight = [m for m in self.inflight if m[0] != p or self.rng.random() < 0.5]

    def handle(self, src: str, actions: list) -> None:
        for a in actions:
            if src in self.dead:
                return
            if isinstance(a, Send):
                if src == self.victim and self.kill_point == "holding_parts" and a.phase == "gather":
                    self.kill(src)  # it reduced its part but not one byte of it leaves
                    return
                self.inflight.append((src, a, sorted(self.rounds[src].suspects)))
            elif isinstance(a, Probe):
                if a.peer in self.dead:
                    self.handle(src, self.rounds[src].peer_failed(a.peer, "probe refused", self.now))
                else:  # a probe carries the prober's suspects, like every message, and is answered
                    sus = sorted(self.rounds[src].suspects)
                    self.handle(a.peer, self.rounds[a.peer].receive(src, "probe", 0, None, suspects=sus, now=self.now))
                    self.rounds[src].peer_alive(a.peer, self.now)
            elif isinstance(a, Done):
                self.done[src] = a
            elif isinstance(a, Failed):
                self.failed[src] = a
            elif isinstance(a, Rejected):
                self.rejected.append((src, a))
        if src == self.victim and self.kill_point == "after_commit" and self.rounds[src].committed is not None:
            self.kill(src)

    def deliver_one(self) -> None:
        src, msg, suspects = self.inflight.pop(self.rng.randrange(len(self.inflight)))
        dst = self.rounds[msg.peer]
        if msg.peer in self.dead:
            if src not in self.dead and self.rng.random() < 0.7:  # a broken stream, or silence
                self.handle(src, self.rounds[src].peer_failed(msg.peer, "stream reset", self.now))
            return
        data = None if msg.data is None else msg.data.clone()
        self.handle(msg.peer, dst.receive(src, msg.phase, msg.part, data, contributors=list(msg.contributors), suspects=suspects,
                                          signer=msg.signer, digest=msg.digest, signature=msg.signature, now=self.now))
        self.deliveries += 1
        if src in self.dead:
            return
        self.handle(src, self.rounds[src].delivered(msg, self.now))
        if src == self.victim and (
            (self.kill_point == "mid_scatter" and msg.phase == "scatter") or (self.kill_point == "mid_gather" and msg.phase == "gather")
        ):
            self.kill(src)
        if self.kill_after is not None and self.deliveries >= self.kill_after and self.victim not in self.dead:
            self.kill(self.victim)

    def run(self) -> None:
        order = list(self.rounds)
        self.rng.shuffle(order)
        for p in order:
            if p == self.victim and self.kill_point == "before_start":
                self.dead.add(p)
                continue
            self.handle(p, self.rounds[p].start(self.vectors[p], now=0.0))
            for _ in range(self.rng.randint(0, len(self.inflight))):
                if self.inflight:  # a kill may have dropped some
                    self.deliver_one()
        for _ in range(100_000):
            live = [p for p in self.rounds if p not in self.dead and self.rounds[p].finished is None]
            if not live:
                return
            if self.inflight:
                self.deliver_one()
                continue
            deadlines = [d for p in live if (d := self.rounds[p].next_deadline()) is not None]
            self.now = max(self.now, min(deadlines))
            for p in live:
                self.handle(p, self.rounds[p].poll(self.now))
        raise AssertionError("simulation did not settle")


def expected(weights: dict[str, float], vectors: dict[str, torch.Tensor], members: list[str], op: str) -> torch.Tensor:
    total = sum((vectors[p].double() * (1.0 if op == "sum" else weights[p]) for p in members), torch.zeros_like(next(iter(vectors.values())), dtype=torch.float64))
    return total / sum(weights[p] for p in members) if op == "weighted_mean" else total


def check_survivors(net: Net, weights: dict[str, float], vectors: dict[str, torch.Tensor], op: str) -> Done:
    survivors = [p for p in weights if p not in net.dead]
    assert not net.failed, net.failed
    assert set(net.done) >= set(survivors)
    first = net.done[survivors[0]]
    for p in survivors:
        assert torch.equal(net.done[p].result, first.result), f"{p} differs from {survivors[0]}"
        assert net.done[p].contributors == first.contributors
    live_contributors = {p for p in survivors if weights[p] > 0}
    assert live_contributors <= set(first.contributors), "a survivor's contribution must never be dropped"
    assert set(first.excluded) <= net.dead
    assert sorted(set(first.contributors) | set(first.excluded)) == sorted(p for p in weights if weights[p] > 0)
    torch.testing.assert_close(first.result.double(), expected(weights, vectors, first.contributors, op), rtol=1e-5, atol=1e-5)
    return first


def make(num_peers: int, numel: int, seed: int, zero: int = -1) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    peers = [f"peer{k:02d}" for k in range(num_peers)]
    weights = {p: float(k % 3 + 1) for k, p in enumerate(peers)}
    if 0 <= zero < num_peers:
        weights[peers[zero]] = 0.0
    return weights, {p: torch.randn(numel, generator=gen) for p in peers}


@settings(max_examples=40, deadline=None)
@given(num_peers=st.integers(1, 6), numel=st.integers(1, 50), seed=st.integers(0, 10_000), data=st.data())
def test_every_replica_gets_identical_weighted_mean(num_peers: int, numel: int, seed: int, data) -> None:
    weights, vectors = make(num_peers, numel, seed)
    for p in weights:
        weights[p] = float(data.draw(st.integers(0, 5)))
    weights["peer00"] = max(weights["peer00"], 1.0)
    net = Net(weights, vectors, op="weighted_mean", seed=seed)
    net.run()
    done = check_survivors(net, weights, vectors, "weighted_mean")
    assert done.excluded == [] and net.now == 0.0, "without faults nobody waits for a deadline"


@pytest.mark.parametrize("kill_point", KILL_POINTS)
@pytest.mark.parametrize("victim_index", [0, 2, 3])
def test_one_replica_dies_at_each_phase(kill_point: str, victim_index: int) -> None:
    for seed in range(8):
        weights, vectors = make(4, 37, seed, zero=1)  # peer01 processed no ticket: it only reduces
        victim = f"peer{victim_index:02d}"
        net = Net(weights, vectors, op="sum", seed=seed, victim=victim, kill_point=kill_point)
        net.run()
        done = check_survivors(net, weights, vectors, "sum")
        if kill_point == "before_start":
            assert done.excluded == [victim]


@settings(max_examples=150, deadline=None)
@given(num_peers=st.integers(2, 6), victim=st.integers(0, 5), kill_after=st.integers(0, 60), seed=st.integers(0, 10_000),
       op=st.sampled_from(["sum", "weighted_mean"]), idle=st.integers(-1, 5))
def test_a_death_after_any_number_of_deliveries_leaves_survivors_identical(num_peers, victim, kill_after, seed, op, idle) -> None:
    weights, vectors = make(num_peers, 23, seed, zero=idle)
    v = f"peer{victim % num_peers:02d}"
    if op == "weighted_mean" and sum(w for p, w in weights.items() if p != v) == 0:
        weights[f"peer{(victim + 1) % num_peers:02d}"] = 1.0
    net = Net(weights, vectors, op=op, seed=seed, victim=v, kill_after=kill_after)
    net.run()
    check_survivors(net, weights, vectors, op)


def test_backup_resends_the_dead_owners_part_instead_of_reducing_without_it() -> None:
    # peer00 owns part 0. It dies right after its successor (peer01) got the reduced part, so the
    # others never see it from peer00; peer01 must send that same part (with peer00 in) on.
    weights, vectors = make(4, 16, 5)
    for seed in range(10):
        net = Net(weights, vectors, op="sum", seed=seed, victim="peer00", kill_point="mid_gather")
        net.run()
        done = check_survivors(net, weights, vectors, "sum")
        part0 = net.rounds["peer01"]._counted.get(0, {})
        if any("peer00" in members for members in part0):
            assert done.contributors == sorted(weights), "the part peer01 got from peer00 decides: peer00 is in"


def test_sum_with_idle_replica_equals_the_sum_of_contributions() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {"a": 3.0, "b": 0.0, "c": 1.0}
    vectors = {p: torch.randn(10, generator=gen) for p in weights}
    vectors["b"] = torch.full((10,), 1e6)  # an idle replica's vector must not leak into the result
    net = Net(weights, vectors, op="sum", seed=1)
    net.run()
    assert all(torch.equal(net.done[p].result, net.done["a"].result) for p in weights)
    torch.testing.assert_close(net.done["a"].result, vectors["a"] + vectors["c"])


def test_result_does_not_depend_on_arrival_order_or_on_who_reduces() -> None:
    gen = torch.Generator().manual_seed(3)
    weights = {f"p{k}": 1.0 + k for k in range(4)}
    # Magnitudes spread wide so that a different addition order would change the low bits.
    vectors = {p: torch.randn(64, generator=gen) * 10 ** (2 * k) for k, p in enumerate(weights)}
    runs = []
    for s in range(6):
        net = Net(weights, vectors, op="weighted_mean", seed=s)
        net.run()
        runs.append(net.done["p0"].result)
    assert all(torch.equal(r, runs[0]) for r in runs)
    # A backup reducing part 0 (its owner p0 died before starting) gets the same bytes for the others' set.
    net = Net(weights, vectors, op="weighted_mean", seed=0, victim="p0", kill_point="before_start")
    net.run()
    net2 = Net({p: w for p, w in weights.items() if p != "p0"}, {p: v for p, v in vectors.items() if p != "p0"}, op="weighted_mean", seed=0)
    net2.run()
    assert torch.equal(net.done["p1"].result, net2.done["p1"].result)


def test_bad_parts_are_rejected_with_a_reason() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 0.0}
    r = make_round(1, "a", weights, 9)  # a reduces part 0 (elements 0..2)
    r.start(torch.zeros(9), now=0.0)

    def reason(peer: str, phase: str, part: int, data: torch.Tensor | None, **kw) -> str:
        (out,) = r.receive(peer, phase, part, data, **kw)
        assert isinstance(out, Rejected)
        return out.reason

    assert "not a participant" in reason("mallory", "scatter", 0, torch.zeros(3))
    assert "does not reduce it" in reason("b", "scatter", 1, torch.zeros(3))
    assert "weight 0" in reason("c", "scatter", 0, torch.zeros(3))
    assert "float32 of 3" in reason("b", "scatter", 0, torch.zeros(4))
    assert "float32 of 3" in reason("b", "scatter", 0, None)
    assert "NaN" in reason("b", "scatter", 0, torch.tensor([0.0, float("nan"), 0.0]))
    assert "out of range" in reason("b", "gather", 9, torch.zeros(3))
    assert "unknown phase" in reason("b", "shout", 0, torch.zeros(3))
    assert "not a subset" in reason("b", "gather", 1, torch.zeros(3), contributors=["a", "c"])
    assert "not a participant" in reason("b", "gather", 1, torch.zeros(3), contributors=["a"], suspects=["mallory"])
    actions = r.receive("b", "scatter", 0, torch.ones(3))  # the real one goes through and reduces
    assert [(s.peer, s.phase, s.part, s.contributors, s.signer) for s in actions if isinstance(s, Send)] == [("b", "gather", 0, ("a", "b"), "a")]
    assert "duplicate" in reason("b", "scatter", 0, torch.ones(3))


def test_a_silent_peer_is_probed_then_suspected_and_left_out() -> None:
    r = make_round(2, "a", {"a": 1.0, "b": 1.0}, 4, floor_s=2.0, bandwidth=Bandwidth(1e9))
    sends = r.start(torch.ones(4), now=100.0)
    assert [(s.peer, s.phase, s.part) for s in sends if isinstance(s, Send)] == [("b", "scatter", 1)]
    assert r.next_deadline() == pytest.approx(101.0)
    assert r.poll(100.5) == []
    assert Probe("b") in r.poll(101.0), "a wait first probes the peer"
    assert r.poll(101.5) == []
    out = r.poll(102.0)  # b never answered: the floor deadline passes, a reduces both parts alone
    (done,) = [x for x in out if isinstance(x, Done)]
    assert done.contributors == ["a"] and done.excluded == ["b"]
    fins = [(s.peer, s.contributors, s.digest) for s in out if isinstance(s, Send) and s.phase == "fin"]
    assert fins == [("b", ("a",), done.digest)], "even a suspected peer is told (if alive, it must fail, not diverge)"
    assert torch.equal(done.result, torch.ones(4))


def test_a_broken_stream_suspects_at_once_and_the_deadline_adapts_to_bandwidth() -> None:
    slow = make_round(0, "a", {"a": 1.0, "b": 1.0}, 1_000_000, floor_s=2.0, bandwidth=Bandwidth(1e6))
    fast = make_round(0, "a", {"a": 1.0, "b": 1.0}, 1_000_000, floor_s=2.0, bandwidth=Bandwidth(1e9))
    assert fast.wait_s() == 2.0 and slow.wait_s() == pytest.approx(4 * 4 * 500_001 / 1e6)
    sends = slow.start(torch.ones(1_000_000), now=0.0)
    (done,) = [x for x in slow.peer_failed("b", "stream reset", now=0.1) if isinstance(x, Done)]
    assert done.excluded == ["b"] and sends


def test_bandwidth_ema_is_carried_across_rounds() -> None:
    bw = Bandwidth(1e6)
    weights = {"a": 1.0, "b": 1.0}
    for rid in range(3):
        ra = make_round(rid, "a", weights, 1000, bandwidth=bw)
        rb = make_round(rid, "b", weights, 1000, bandwidth=Bandwidth())
        out = {"a": ra.start(torch.ones(1000), now=10.0), "b": rb.start(torch.ones(1000), now=10.0)}
        while any(isinstance(x, Send) for acts in out.values() for x in acts):
            nxt: dict[str, list] = {"a": [], "b": []}
            for src, acts in out.items():
                for s in acts:
                    if isinstance(s, Send):
                        dst = ra if s.peer == "a" else rb
                        nxt[s.peer] += dst.receive(src, s.phase, s.part, s.data, contributors=list(s.contributors),
                                                   signer=s.signer, digest=s.digest, signature=s.signature, now=10.5)
                        nxt[src] += (ra if src == "a" else rb).delivered(s, now=10.5)
            out = nxt
        assert isinstance(ra.finished, Done)
    # Each round 'a' received 2 x 500 floats in 0.5 s = 4000 B/s, well below the 1 MB/s guess.
    assert bw.num_samples == 3 and bw.bytes_per_s < 1e6 * 0.7**3 + 4000


def test_a_replica_that_others_believe_dead_fails_instead_of_diverging() -> None:
    r = make_round(3, "a", {"a": 1.0, "b": 1.0, "c": 1.0}, 6)
    r.start(torch.ones(6), now=0.0)
    (failed,) = r.receive("b", "scatter", 0, torch.ones(2), suspects=["a"], now=0.1)
    assert isinstance(failed, Failed) and "believes this replica died" in failed.reason


def test_a_fin_with_a_different_contributor_set_fails_the_round() -> None:
    r = make_round(4, "a", {"a": 1.0, "b": 1.0}, 2)
    r.start(torch.ones(2), now=0.0)
    r.receive("b", "fin", 0, None, **signed_fin(r, "b", ["b"], bytes(32)))
    r.receive("b", "scatter", 0, torch.ones(1))
    part = torch.full((1,), 2.0)
    (failed,) = [x for x in r.receive("b", "gather", 1, part, **signed_part(r, "b", 1, ["a", "b"], part)) if isinstance(x, Failed)]
    assert "different contributor set" in failed.reason
    assert [e.peer for e in failed.evidence] == ["a", "b"], "both signed fins are kept as evidence"


def test_timeout_fails_naming_the_missing_peers() -> None:
    r = make_round(2, "a", {"a": 1.0, "b": 1.0}, 4, timeout_s=1.0, floor_s=5.0)
    r.start(torch.ones(4), now=0.0)
    (failed,) = [x for x in r.poll(1.0) if isinstance(x, Failed)]
    assert failed.missing == ["b"] and "timed out" in failed.reason


def test_single_replica_finishes_at_start() -> None:
    r = make_round(0, "solo", {"solo": 2.0}, 5)
    (done,) = r.start(torch.arange(5, dtype=torch.float32), now=0.0)
    assert isinstance(done, Done) and done.contributors == ["solo"]
    assert torch.equal(done.result, torch.arange(5, dtype=torch.float32))


def test_participant_must_be_in_weights() -> None:
    with pytest.raises(ValueError, match="not a participant"):
        make_round(0, "x", {"a": 1.0}, 3)
