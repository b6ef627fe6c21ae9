"""A round's result taken from a participant is accepted only on a strict majority of the participants' signed
fins (protocol/collective/result_proof.py; issue 27, rule 1): a liar among the participants cannot pass a made-up
result to a replica that was left out of the round or whose own round failed."""

from __future__ import annotations

import torch

from protolearn.protocol.collective.result_proof import HeldFin, fins_of, unproven, vector_digest
from protolearn.protocol.statements import fin_statement, members_mask, op_tag, round_digest
from tests.unit.test_collective import Net, fake_sign, fake_verify

WEIGHTS = {"a": 2.0, "b": 1.0, "liar": 1.0}


def _fin(signer: str, result: torch.Tensor, members: list[str], *, round_id: int = 7, weights: dict[str, float] = WEIGHTS,
         compression: str = "none") -> HeldFin:
    peers = sorted(weights)
    dig = round_digest(round_id, weights, result.numel(), op_tag("sum", compression=compression))
    mask = members_mask(peers, members)
    digest = vector_digest(result, len(peers))
    return HeldFin(signer, mask, digest, fake_sign(signer)(fin_statement(dig, mask, digest)))


def _why(result: torch.Tensor, fins: list[HeldFin], **kw: object) -> str:
    args: dict = {"round_id": 7, "weights": WEIGHTS, "op": "sum", "rule_tag": "mean", "cross_check": False, "verify": fake_verify}
    args.update(kw)
    return unproven(result, fins, **args)


def test_a_majority_of_fins_for_the_full_set_proves_the_result() -> None:
    result = torch.arange(10, dtype=torch.float32)
    full = sorted(WEIGHTS)
    assert _why(result, [_fin("a", result, full), _fin("b", result, full)]) == ""
    assert "only 1 of the round's 3" in _why(result, [_fin("a", result, full)])


def test_a_liar_cannot_prove_a_made_up_result_with_honest_fins_or_its_own() -> None:
    honest = torch.arange(10, dtype=torch.float32)
    forged = honest.clone()
    forged[3] += 1.0
    full = sorted(WEIGHTS)
    fins = [_fin("a", honest, full), _fin("b", honest, full), _fin("liar", forged, full)]
    assert _why(forged, fins) != "", "the honest fins name another result hash"
    # Its own fin twice, or a fin it made up for an honest signer, counts once or not at all.
    twice = [_fin("liar", forged, full), _fin("liar", forged, full)]
    assert _why(forged, twice) != ""
    fake = HeldFin("a", members_mask(full, full), vector_digest(forged, 3), fake_sign("liar")(b"x" * 10))
    assert _why(forged, [_fin("liar", forged, full), fake]) != ""
    assert _why(honest, fins) == ""


def test_fins_of_a_partial_set_another_round_or_outsiders_prove_nothing() -> None:
    result = torch.ones(5)
    full = sorted(WEIGHTS)
    partial = ["a", "b"]  # a round that left a replica out is never served, and its fins prove nothing here
    assert _why(result, [_fin("a", result, partial), _fin("b", result, partial)]) != ""
    assert _why(result, [_fin("a", result, full, round_id=8), _fin("b", result, full, round_id=8)]) != ""
    outsiders = {"a": 2.0, "b": 1.0, "liar": 1.0, "x": 1.0}
    assert _why(result, [_fin("x", result, full, weights=outsiders), _fin("a", result, full)]) != ""
    assert _why(result, [_fin("a", result, full), _fin("b", result, full)], rule_tag="trimmed_mean:0.2") != "", "another rule"


def test_a_finished_rounds_held_fins_prove_its_result() -> None:
    """The fins a real round holds when it finishes are what a serving participant sends."""
    numel = 11
    vectors = {p: torch.full((numel,), float(k + 1)) for k, p in enumerate(sorted(WEIGHTS))}
    net = Net(dict(WEIGHTS), vectors, op="sum", seed=0)
    net.run()
    assert set(net.done) == set(WEIGHTS), net.failed
    for p, done in net.done.items():
        fins = fins_of(net.rounds[p].peers, net.rounds[p].held_fins())
        assert {f.signer for f in fins} == set(WEIGHTS)
        assert _why(done.result, fins) == ""


def test_a_compressed_rounds_fins_prove_its_result_only_under_its_compression() -> None:
    """Under ``[sync] compression`` a round's digest binds the slice compression: its fins prove its decoded
    result to a taker that names the same compression, and nothing to one that names another (or none), so
    a fetched vector is proven for exactly the round it came from. A PowerSGD factor round is a raw round of
    its own length: the proof is over that length."""
    result = torch.arange(7, dtype=torch.float32)
    full = sorted(WEIGHTS)
    fins = [_fin(p, result, full, compression="int8") for p in ("a", "b")]
    assert _why(result, fins, compression="int8") == ""
    assert _why(result, fins) != "", "a compressed round's fins prove nothing to an uncompressed taker"
    assert _why(result, fins, compression="topk:0.05") != "", "nor under another compression"
    raw = [_fin(p, result, full) for p in ("a", "b")]
    assert _why(result, raw, compression="int8") != "", "a raw round's fins prove nothing to a compressed taker"
    factor = torch.arange(3, dtype=torch.float32)  # a shorter factor vector: its own round digest
    assert _why(factor, [_fin(p, factor, full) for p in ("a", "b")]) == ""
    assert _why(factor, raw) != ""
