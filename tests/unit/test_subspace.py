"""The subspace parametrisation (stages/) and the ``subspace`` codec (protocol/codecs/subspace.py).

What a user relies on: a subspace-constrained model's boundary tensors cross the wire as k numbers
per token (plus the token ids) and come back exactly, in both directions, at every boundary; a model
that is not constrained is refused with a clear error instead of being degraded; a run config that
cannot work is one line naming the field; and hostile frames are refused naming the peer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from protolearn.codec_spec import parse_codec_spec
from protolearn.errors import ConfigError
from protolearn.protocol.codecs import CodecContext, LinkSimulator, decode, make_encoder, token_ids
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import TensorFrame
from protolearn.stages.config import RunConfig
from protolearn.stages.reference import ReferenceTrainer
from protolearn.stages.stage import build_stage
from protolearn.subspace import make_subspace
from tests.support.runs import tiny_run, write_corpus


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def subspace_run(folder: Path, *, layers: list[int], rank: int | None = 6, codec: str = "none", tail: int = 0, period: int = 1, seed: int = 3) -> RunConfig:
    return tiny_run(
        layers, seed=seed, codec=codec, corpus=write_corpus(folder, 8, "def f(x):\n    return x + 1  # abc\n", 30),
        model={"d_model": 48, "d_ff": 64}, optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "total_steps": 30, "clip_norm": 1.0},
        subspace={"rank": rank, "tail_blocks": tail, "period": period},
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- the basis --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7])
def test_the_basis_is_orthonormal_the_fixed_embedding_orthogonal_to_it_and_both_follow_from_the_seed(seed: int) -> None:
    print(f"run seed {seed}")
    sub = make_subspace(seed, 259, 64, 8, 0.02)
    u, e = sub.basis, sub.fixed_embedding
    assert u.shape == (64, 8) and e.shape == (259, 64) and u.dtype == e.dtype == torch.float32
    assert torch.allclose(u.T @ u, torch.eye(8), atol=1e-6)
    assert float((e @ u).abs().max()) < 1e-6 * float(e.abs().max()) * 64
    make_subspace.cache_clear()
    again = make_subspace(seed, 259, 64, 8, 0.02)
    assert torch.equal(again.basis, u) and torch.equal(again.fixed_embedding, e)
    other = make_subspace(seed + 1, 259, 64, 8, 0.02)
    assert not torch.equal(other.basis, u)


# -- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("updates", "field"),
    [
        ({"codec": "subspace", "subspace.rank": None}, "'codec'"),
        ({"subspace.rank": 48}, "'subspace.rank'"),
        ({"subspace.tail_blocks": 2}, "'subspace.tail_blocks'"),
        ({"codec": "subspace:topk"}, "codec='subspace:topk'"),
        ({"subspace.period": 0}, "'subspace.period'"),
    ],
)
def test_an_impossible_subspace_config_is_one_line_naming_the_field(tmp_path: Path, updates: dict, field: str) -> None:
    run = subspace_run(tmp_path, layers=[1, 1])
    with pytest.raises(ConfigError) as err:
        run.replace(**updates)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_the_codec_spec_names_its_inner_codec() -> None:
    assert str(parse_codec_spec("subspace")) == "subspace:fp16"
    assert str(parse_codec_spec("subspace:int8")) == "subspace:int8"
    assert parse_codec_spec("subspace:none").inner == "none"


# -- exact reconstruction at every boundary, both directions -----------------------------------------


class Checker:
    """A reference-trainer boundary hook that round-trips each tensor through ``codec`` and records the error."""

    def __init__(self, run: RunConfig, codec: str) -> None:
        self.subspace = make_subspace(*run.subspace_key)
        self.codec = codec
        self.errors: dict[tuple[int, str], list[float]] = {}
        self.bytes: dict[str, list[int]] = {"fwd": [], "bwd": []}

    def __call__(self, boundary: int, direction: str, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ctx = CodecContext(self.subspace, direction, tokens if direction == "fwd" else None)
        frame, stats = make_encoder(self.codec).encode(t, context=ctx)
        back = decode(frame, peer="test", shape=list(t.shape), context=ctx)
        self.errors.setdefault((boundary, direction), []).append(rel(back, t))
        self.bytes[direction].append(stats.wire_bytes)
        assert stats.tokens == t.shape[0] * t.shape[1]
        if direction == "fwd":
            assert torch.equal(token_ids(frame, peer="test", subspace=self.subspace), tokens)
        return t  # the model trains on the exact tensor; the check only watches


def test_decode_encode_is_exact_in_both_directions_at_every_boundary_while_the_model_trains(tmp_path: Path) -> None:
    run = subspace_run(tmp_path, layers=[1, 1, 2], tail=1)  # 3 stages, 2 boundaries, the last block unconstrained
    check = Checker(run, "subspace:none")
    trainer = ReferenceTrainer(run, boundary=check)
    losses = [r["loss"] for r in trainer.train(12, eval_every=100)]
    assert losses[-1] < losses[0]  # it trains
    assert set(check.errors) == {(0, "fwd"), (1, "fwd"), (0, "bwd"), (1, "bwd")}
    worst = {key: max(v) for key, v in check.errors.items()}
    print(f"worst relative reconstruction error per (boundary, direction): {worst}")
    assert all(e <= 1e-5 for e in worst.values()), worst
    # k = 6 float32 per token and two bytes of token id forward, k float32 back.
    tokens = 3 * 16
    assert set(check.bytes["fwd"]) == {tokens * (6 * 4 + 2)}
    assert set(check.bytes["bwd"]) == {tokens * 6 * 4}


@pytest.mark.parametrize(("inner", "bound", "per_token"), [("fp16", 2e-3, (6 * 2 + 2, 6 * 2)), ("int8", 2e-2, (6 + 4 + 2, 6 + 4))])
def test_a_narrow_inner_codec_costs_only_its_own_rounding(tmp_path: Path, inner: str, bound: float, per_token: tuple[int, int]) -> None:
    run = subspace_run(tmp_path, layers=[1, 1])
    check = Checker(run, f"subspace:{inner}")
    ReferenceTrainer(run, boundary=check).train(3, eval_every=100)
    worst = max(max(v) for v in check.errors.values())
    print(f"{inner}: worst relative error {worst:.2e}")
    assert worst <= bound
    assert set(check.bytes["fwd"]) == {48 * per_token[0]} and set(check.bytes["bwd"]) == {48 * per_token[1]}


def test_training_through_the_codec_matches_training_the_model_step_by_step(tmp_path: Path) -> None:
    run = subspace_run(tmp_path, layers=[1, 2], codec="subspace:none")
    plain = ReferenceTrainer(run)
    links = LinkSimulator(run.codec_spec, plain.stages[0].subspace)
    wired = ReferenceTrainer(run, boundary=links, corpus=plain.corpus)
    for _ in range(8):
        a, b = plain.train_step()["loss"], wired.train_step()["loss"]
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    assert links.bytes_per_token() == (6 * 4 + 2) + 6 * 4


def test_the_projection_period_projects_every_period_th_step_only(tmp_path: Path) -> None:
    run = subspace_run(tmp_path, layers=[1, 1], period=3)
    stage = build_stage(run, 1)
    u = stage.subspace_basis
    w = stage.blocks["1"].attn.wo.weight.detach()  # the parameter itself, without autograd
    off = lambda: float((w - u @ (u.T @ w)).norm())  # noqa: E731
    assert off() < 1e-6
    with torch.no_grad():
        w.add_(0.01)
    stage.after_step(0)
    stage.after_step(1)
    assert off() > 1e-3  # steps 0 and 1 leave the drift
    stage.after_step(2)
    assert off() < 1e-5  # step 2 is the 3rd: projected


# -- refusals -------------------------------------------------------------------------------------


def test_an_unconstrained_model_is_refused_by_the_encoder_not_degraded(tmp_path: Path) -> None:
    free = build_stage(subspace_run(tmp_path, layers=[1, 1], rank=None), 0)
    sub = make_subspace(3, 259, 48, 6, 0.02)
    tokens = torch.randint(0, 259, (3, 16), generator=torch.Generator().manual_seed(0))
    h = free.infer(tokens)
    with pytest.raises(ProtocolError, match="not subspace-constrained"):
        make_encoder("subspace").encode(h, context=CodecContext(sub, "fwd", tokens))
    with pytest.raises(ProtocolError, match=r"set \[subspace\] rank"):
        make_encoder("subspace").encode(h, context=None)
    # A run that projects only every few steps accepts the drift, and the error says how much was lost.
    _, stats = make_encoder("subspace:none").encode(h, context=CodecContext.for_run(sub, 4, "fwd", tokens))
    assert stats.rel_error > 0.1


def hostile(frame: TensorFrame, **changes) -> TensorFrame:
    return TensorFrame(**{**frame.model_dump(), **changes})


def test_hostile_subspace_frames_are_refused_naming_the_peer(tmp_path: Path) -> None:
    run = subspace_run(tmp_path, layers=[1, 1])
    stage = build_stage(run, 0)
    sub = stage.subspace
    tokens = torch.randint(0, 259, (3, 16), generator=torch.Generator().manual_seed(1))
    h = stage.infer(tokens)
    ctx = CodecContext(sub, "fwd", tokens)
    frame, _ = make_encoder("subspace").encode(h, context=ctx)
    recv = CodecContext(sub, "fwd")
    assert rel(decode(frame, peer="p", shape=[3, 16, 48], context=recv), h) < 2e-3
    bad_ids = bytearray(frame.aux)
    bad_ids[0:2] = (5000).to_bytes(2, "little")
    cases = {
        "ids out of range": (hostile(frame, aux=bytes(bad_ids)), recv),
        "truncated coefficients": (hostile(frame, data=frame.data[:-2]), recv),
        "no token ids": (hostile(frame, aux=b""), recv),
        "wrong width": (hostile(frame, shape=[3, 16, 40]), recv),
        "no subspace here": (frame, CodecContext()),
    }
    for what, (f, context) in cases.items():
        with pytest.raises(ProtocolError) as err:
            decode(f, peer="peer-x", shape=None, context=context)
        assert err.value.peer == "peer-x", what
    # An empty tensor is decoded as one, not a crash.
    empty, _ = make_encoder("subspace").encode(h[:0], context=CodecContext(sub, "fwd", tokens[:0]))
    assert decode(empty, peer="peer-x", shape=None, context=recv).shape == (0, 16, 48)
    # A gradient frame where an activation is expected is refused too (its layout has no ids).
    g, _ = make_encoder("subspace").encode(h - sub.fixed_embedding[tokens], context=CodecContext(sub, "bwd"))
    with pytest.raises(ProtocolError, match="aux bytes"):
        decode(g, peer="peer-x", shape=[3, 16, 48], context=recv)
