"""The collective with a slice compression (``int8``, ``topk``): the fault-tolerance argument still holds.

The rounds run on ``test_collective``'s in-memory network (random delivery order, probes, a fake clock,
deaths at any point) and its Byzantine schedules, with one change: every part now crosses the "wire" as
the blob it travels as (:mod:`protolearn.protocol.sync_compression.wire`), decoded by the receiver. An
honest sender's blob must decode to exactly what it sent; a liar sends any float32 values (as a dense
blob, which carries anything). Honest survivors must finish bit-identical, and without liars with
exactly the compressed reduction of the contributors' contributions, part by part.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.protocol.collective import Aggregation, Bandwidth, CollectiveRound, Done, Send
from protolearn.protocol.collective.ownership import part_bounds, reduce_part
from protolearn.protocol.collective.robust import robust_reduce
from protolearn.protocol.reducer_check import peer_id_public_key, verify_reducer_fault
from protolearn.protocol.statements import verify_ed25519
from protolearn.protocol.sync_compression import SliceCodec, slice_codec, wire
from protolearn.sync_spec import parse_sync_compression

from tests.unit.test_collective import HARMLESS, KILL_POINTS, ByzNet, ForgingRound, Net, byzantine_schedule, fake_sign, fake_verify, make
from tests.unit.test_collective_robust import CheckedNet, assert_agree, identities

CODECS = {name: slice_codec(parse_sync_compression(name)) for name in ("int8", "topk:0.25")}


def projected(codec: SliceCodec, weights: dict[str, float], vectors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each replica's contribution: its vector projected part by part over the round's parts."""
    bounds = part_bounds(next(iter(vectors.values())).numel(), len(weights))
    return {p: codec.contributions(v, bounds) for p, v in vectors.items()}


def exact(codec: SliceCodec, weights: dict[str, float], vectors: dict[str, torch.Tensor], members: list[str], op: str,
          agg: Aggregation = Aggregation()) -> torch.Tensor:
    """The compressed result over ``members``: every part reduced from the contributions, then projected."""
    bounds = part_bounds(next(iter(vectors.values())).numel(), len(weights))
    return torch.cat([codec.reduced(robust_reduce({p: v[a:b] for p, v in vectors.items()}, members, weights, op, b - a, agg))
                      for a, b in bounds])


@dataclass(frozen=True)
class Carried(Send):
    """A send that has crossed the wire (been encoded and decoded)."""


class Wire:
    """Mixed into a Net: every part is carried as its blob. ``liars`` send dense blobs of whatever they hold."""

    codec: SliceCodec
    blobs: int = 0

    def carry(self, src: str, msg: Send) -> Send:
        if msg.data is None:
            return msg
        if src in getattr(self, "liars", {}):
            blob = wire.encode_sparse(msg.data)  # any values: sparse or dense, lossless
        else:
            blob = self.codec.encode(msg.data)
        got = wire.decode(blob, peer=src, length=msg.data.numel(), max_length=msg.data.numel())
        assert torch.equal(got, msg.data), f"{src}'s {msg.phase} of part {msg.part} did not survive its encoding"
        self.blobs += 1
        return Carried(msg.peer, msg.phase, msg.part, got, msg.contributors, msg.signer, msg.digest, msg.signature, msg.inputs, msg.vetoed)

    def deliver_one(self) -> None:
        inflight = self.inflight  # type: ignore[attr-defined]
        for k, (src, msg, sus) in enumerate(inflight):
            if not isinstance(msg, Carried):
                inflight[k] = (src, self.carry(src, msg), sus)
        super().deliver_one()  # type: ignore[misc]


class CodecNet(Wire, Net):
    def __init__(self, codec: SliceCodec, weights: dict[str, float], vectors: dict[str, torch.Tensor], *, op: str, seed: int, **kill) -> None:
        self.codec = codec
        vectors = projected(codec, weights, vectors)
        super().__init__(weights, vectors, op=op, seed=seed, **kill)
        numel = next(iter(vectors.values())).numel()
        self.rounds = {p: CollectiveRound(7, p, weights, numel, op=op, floor_s=1.0, bandwidth=Bandwidth(1e9), sign=fake_sign(p),
                                          verify=fake_verify, codec=codec) for p in weights}


def check(net: CodecNet, weights: dict[str, float], op: str) -> Done:
    survivors = [p for p in weights if p not in net.dead]
    assert not net.failed, {p: f.reason for p, f in net.failed.items()}
    first = net.done[survivors[0]]
    for p in survivors:
        assert torch.equal(net.done[p].result, first.result) and net.done[p].digest == first.digest, f"{p} differs"
    assert {p for p in survivors if weights[p] > 0} <= set(first.contributors)
    assert set(first.excluded) <= net.dead
    assert torch.equal(first.result, exact(net.codec, weights, net.vectors, first.contributors, op))
    assert net.blobs > 0
    return first


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_one_replica_dies_at_each_phase_with_compression(name: str, kill_point: str) -> None:
    for seed in range(6):
        weights, vectors = make(4, 150, seed, zero=1)
        victim = ["peer00", "peer02", "peer03"][seed % 3]
        net = CodecNet(CODECS[name], weights, vectors, op="sum", seed=seed, victim=victim, kill_point=kill_point)
        net.run()
        done = check(net, weights, "sum")
        if kill_point == "before_start":
            assert victim not in done.contributors


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(CODECS)), num_peers=st.integers(2, 6), victim=st.integers(0, 5), kill_after=st.integers(0, 60),
       seed=st.integers(0, 10_000), op=st.sampled_from(["sum", "weighted_mean"]), idle=st.integers(-1, 5))
def test_a_death_after_any_number_of_deliveries_leaves_compressed_survivors_identical(name, num_peers, victim, kill_after, seed, op, idle) -> None:
    weights, vectors = make(num_peers, 97, seed, zero=idle)
    v = f"peer{victim % num_peers:02d}"
    if op == "weighted_mean" and sum(w for p, w in weights.items() if p != v) == 0:
        weights[f"peer{(victim + 1) % num_peers:02d}"] = 1.0
    net = CodecNet(CODECS[name], weights, vectors, op=op, seed=seed, victim=v, kill_after=kill_after)
    net.run()
    check(net, weights, op)


def test_topk_parts_travel_sparse_and_int8_parts_as_one_byte_a_value() -> None:
    weights, vectors = make(4, 4000, 0)
    for name, at_most in (("topk:0.25", 0.5), ("int8", 0.27)):
        codec = CODECS[name]
        contributions = projected(codec, weights, vectors)
        bounds = part_bounds(4000, 4)
        for p, c in contributions.items():
            for a, b in bounds:
                assert len(codec.encode(c[a:b])) <= at_most * 4 * (b - a) + wire.HEAD_BYTES, (name, p)


class CodecByzNet(Wire, ByzNet):
    pass


def compressed_schedule(seed: int, codec: SliceCodec) -> tuple[CodecByzNet, dict, dict, str, set[str]]:
    """``test_collective``'s Byzantine schedule ``seed``, with every round compressed by ``codec``."""
    net, weights, vectors, desc, liars = byzantine_schedule(seed)
    cnet = CodecByzNet.__new__(CodecByzNet)
    cnet.__dict__.update(net.__dict__)
    cnet.codec, cnet.blobs = codec, 0
    cnet.vectors = projected(codec, weights, vectors)
    numel = next(iter(vectors.values())).numel()
    op, max_liars = net.rounds[next(iter(weights))].op, len(liars)
    cnet.rounds = {p: (ForgingRound if "forge_part" in net.liars.get(p, ()) else CollectiveRound)(
        7, p, weights, numel, op=op, floor_s=1.0, bandwidth=Bandwidth(1e9), max_liars=max_liars, sign=fake_sign(p), verify=fake_verify,
        codec=codec) for p in weights}
    return cnet, weights, cnet.vectors, f"{desc}, codec {codec.tag}", liars


@pytest.mark.parametrize("name", sorted(CODECS))
def test_honest_compressed_survivors_agree_bit_for_bit_or_fail_with_liars_among_them(name: str) -> None:
    codec, outcomes = CODECS[name], {"done": 0, "failed": 0, "split": 0}
    for seed in range(300):
        net, weights, vectors, desc, liars = compressed_schedule(seed, codec)
        net.run()
        honest = [p for p in weights if p not in liars and p not in net.dead]
        assert not [p for p in honest if p not in net.done and p not in net.failed], f"{desc}: an honest survivor never finished"
        done = [p for p in honest if p in net.done]
        for p in done[1:]:
            a, b = net.done[done[0]], net.done[p]
            assert torch.equal(a.result, b.result) and a.contributors == b.contributors and a.digest == b.digest, f"{desc}: honest replicas differ"
        if done and all(lies <= HARMLESS and (net.victim is None or "forge_other" not in lies) for lies in net.liars.values()):
            first = net.done[done[0]]
            assert not [p for p in honest if p in net.failed], f"{desc}: harmless lies failed a round"
            assert torch.equal(first.result, exact(codec, weights, vectors, first.contributors, net.rounds[done[0]].op)), desc
        outcomes["done" if len(done) == len(honest) else "failed" if not done else "split"] += 1
    assert outcomes["done"] > 30 and outcomes["failed"] + outcomes["split"] > 30, outcomes


class CodecCheckedNet(Wire, CheckedNet):
    """``test_collective_robust``'s cross-checked net (Ed25519 keys, tampering owners), compressed."""

    def __init__(self, codec: SliceCodec, num_peers: int, numel: int, *, seed: int, agg: Aggregation = Aggregation(), **kw) -> None:
        super().__init__(num_peers, numel, seed=seed, agg=agg, **kw)
        self.codec, self.blobs = codec, 0
        self.vectors = projected(codec, self.weights, self.vectors)
        ids = {i.peer_id: i for i in identities(num_peers)}
        self.rounds = {p: CollectiveRound(7, p, self.weights, numel, floor_s=1.0, bandwidth=Bandwidth(1e9), aggregation=agg, cross_check=True,
                                          sign=ids[p].sign, verify=verify_ed25519, codec=codec,
                                          part_filter=(lambda j, d: d + 1.0) if p in self.tamperers else None) for p in self.weights}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_tampering_owner_of_a_compressed_part_is_vetoed_with_evidence_that_verifies_under_the_runs_compression(name: str) -> None:
    codec = CODECS[name]
    for seed in range(3):
        clean = CodecCheckedNet(codec, 4, 61, seed=seed)
        clean.run()
        done, failed = assert_agree(clean)
        assert len(done) == 4 and not failed
        assert torch.equal(clean.done[done[0]].result, exact(codec, clean.weights, clean.vectors, sorted(clean.weights), "sum"))

        liar = seed % 4
        net = CodecCheckedNet(codec, 4, 61, seed=seed, tamperers=frozenset({liar}))
        net.run()
        done, failed = assert_agree(net)
        assert not done, "the wrong part is never committed"
        checker = identities(4)[(liar + 1) % 4].peer_id
        faults = net.failed[checker].reducer_faults
        assert faults
        for fault in faults:
            ok, why = verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=Aggregation(), compression=codec.tag)
            assert ok, why
            # Under another compression the statements do not verify: the round digest binds the codec.
            assert not verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=Aggregation())[0]
            assert not verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=Aggregation(), compression="zip")[0]


def test_a_part_that_is_not_int8_blocks_still_travels_exactly() -> None:
    # An honest backup relays the part its dead owner signed, whatever its values (a liar's, say).
    codec = CODECS["int8"]
    part = torch.tensor([0.1, 0.2, 0.3])
    blob = codec.encode(part)
    assert blob[0] == wire.DENSE and torch.equal(wire.decode(blob, peer="p", length=3, max_length=3), part)
    with pytest.raises(ValueError, match="project it"):
        wire.encode_int8(part)


def test_reduce_part_is_what_a_compressed_round_projects() -> None:
    # A guard for exact(): with the mean, the robust reduction is the plain one.
    weights, vectors = make(3, 10, 0)
    members = sorted(weights)
    assert torch.equal(robust_reduce(vectors, members, weights, "sum", 10, Aggregation()), reduce_part(vectors, members, weights, "sum", 10))
