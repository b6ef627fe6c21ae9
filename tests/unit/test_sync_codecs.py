"""Replica-sync compression, part by part: the grammar, int8 blocks, top-k, the wire blob, error feedback.

Property-based where it fits: projections are exact, idempotent and within their bounds; every encoding
decodes to exactly what was encoded; a hostile blob is refused with a reason naming the peer before a
tensor is built; error feedback loses no gradient mass, and a failed or redone step never counts twice.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.sync_compression import ErrorFeedback, SliceCompressor, blockfloat, slice_codec, sparse, wire
from protolearn.protocol.collective.ownership import part_bounds
from protolearn.sync_spec import SyncCompression, SyncSpecError, parse_sync_compression

finite32 = st.floats(min_value=-(2.0**20), max_value=2.0**20, allow_nan=False, width=32)
scales = st.sampled_from([1e-40, 1e-20, 1e-6, 1.0, 1e6, 1e25])


def vector(values: list[float], scale: float) -> torch.Tensor:
    return (torch.tensor(values, dtype=torch.float32) * scale).to(torch.float32)


# -- the grammar ---------------------------------------------------------------------------------------
def test_the_grammar_parses_each_form_and_refuses_the_rest_in_one_line() -> None:
    assert parse_sync_compression("none") == SyncCompression("none")
    assert str(parse_sync_compression("topk")) == "topk:0.01" and parse_sync_compression("topk:0.03").fraction == 0.03
    assert str(parse_sync_compression("powersgd")) == "powersgd:4" and parse_sync_compression("powersgd:64").rank == 64
    assert str(parse_sync_compression("int8")) == "int8"
    for bad in ("zip", "int8:2", "topk:0", "topk:1.5", "topk:nan", "topk:x", "powersgd:0", "powersgd:-1", "powersgd:2.5",
                "powersgd:99999", "none:1", "x" * 40, 3):
        with pytest.raises(SyncSpecError) as err:
            parse_sync_compression(bad)
        assert "\n" not in str(err.value) and "sync.compression" in str(err.value)


# -- int8 blocks -----------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite32, min_size=0, max_size=300), scale=scales)
def test_int8_blocks_are_exact_idempotent_and_within_half_a_step(values: list[float], scale: float) -> None:
    x = vector(values, scale)
    if not bool(torch.isfinite(x).all()):
        return
    p = blockfloat.project(x)
    assert torch.equal(blockfloat.project(p), p), "projecting twice changes nothing"
    e, q = blockfloat.quantize(x)
    assert q.dtype == torch.int8 and (q.numel() == 0 or int(q.abs().max()) <= 127)
    step = torch.pow(2.0, e.double())  # (num_blocks,)
    for b in range(blockfloat.num_blocks(x.numel())):
        blk = slice(b * blockfloat.BLOCK, (b + 1) * blockfloat.BLOCK)
        err = (x[blk].double() - p[blk].double()).abs().max()
        assert err <= step[b] / 2, "every value within half a step"
        amax = float(x[blk].abs().max())
        if e[b] > blockfloat.E_MIN:  # the smallest fitting exponent: one less would not fit
            assert amax / float(step[b] / 2) >= 127.5
    blob = wire.encode_int8(p)
    assert len(blob) == wire.HEAD_BYTES + x.numel() + blockfloat.num_blocks(x.numel())
    assert torch.equal(wire.decode(blob, peer="p", length=x.numel(), max_length=x.numel()), p)


def test_int8_blocks_cover_subnormals_and_refuse_what_cannot_fit() -> None:
    tiny = torch.tensor([2.0**-149, -3 * 2.0**-149, 127 * 2.0**-149], dtype=torch.float32)
    assert torch.equal(blockfloat.project(tiny), tiny), "subnormals are exact at the least exponent"
    mixed = torch.tensor([2.0**-149, 2.0**-140], dtype=torch.float32)
    assert torch.equal(blockfloat.project(mixed), torch.tensor([0.0, 2.0**-140])), "a block shares one exponent"
    assert torch.equal(blockfloat.project(torch.zeros(70)), torch.zeros(70))
    with pytest.raises(ValueError, match="too large"):
        blockfloat.project(torch.tensor([3e38]))
    with pytest.raises(ValueError, match="NaN"):
        blockfloat.project(torch.tensor([1.0, float("nan")]))


# -- top-k -----------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-5, 5), min_size=1, max_size=200), fraction=st.floats(0.001, 1.0))
def test_topk_keeps_the_largest_with_ties_to_the_lowest_index_and_is_idempotent(values: list[int], fraction: float) -> None:
    x = torch.tensor(values, dtype=torch.float32)  # many ties on purpose
    k = sparse.topk_count(fraction, x.numel())
    assert k == min(x.numel(), max(1, math.ceil(fraction * x.numel())))
    p = sparse.project(x, fraction)
    kept = torch.where(p != 0)[0]
    assert kept.numel() <= k and torch.equal(p[kept], x[kept])
    # The reference: a stable sort by decreasing magnitude.
    order = sorted(range(x.numel()), key=lambda i: (-abs(values[i]), i))[:k]
    want = torch.zeros_like(x)
    want[order] = x[order]
    assert torch.equal(p, want)
    assert torch.equal(sparse.project(p, fraction), p)
    blob = wire.encode_sparse(p)
    assert torch.equal(wire.decode(blob, peer="p", length=x.numel(), max_length=x.numel()), p)


def test_a_sparse_part_travels_as_indices_and_values_and_a_dense_one_as_float32() -> None:
    x = torch.zeros(1000)
    x[[3, 500, 999]] = torch.tensor([1.0, -2.0, 3.0])
    blob = wire.encode_sparse(x)
    assert blob[0] == wire.SPARSE and len(blob) == wire.HEAD_BYTES + 3 * 8
    dense = wire.encode_sparse(torch.arange(1.0, 11.0))
    assert dense[0] == wire.DENSE and len(dense) == wire.HEAD_BYTES + 40


# -- hostile blobs ---------------------------------------------------------------------------------------
def head(form: int, n: int) -> bytes:
    return struct.pack("<BI", form, n)


HOSTILE = {
    "short": (b"\x01\x00", "shorter than"),
    "form": (head(9, 4) + b"\x00" * 16, "unknown form"),
    "length": (head(wire.DENSE, 5) + b"\x00" * 20, "the part has 4"),
    "int8 size": (head(wire.INT8, 4) + b"\x00" * 4, "must be 5 bytes"),
    "exponent": (head(wire.INT8, 4) + bytes([255]) + b"\x00" * 4, "exponent above"),
    "int8 -128": (head(wire.INT8, 4) + bytes([149]) + b"\x80\x00\x00\x00", "-128"),
    "dense nan": (head(wire.DENSE, 4) + np.array([0, np.nan, 0, 0], dtype="<f4").tobytes(), "NaN"),
    "sparse odd": (head(wire.SPARSE, 4) + b"\x00" * 7, "8 per entry"),
    "sparse range": (head(wire.SPARSE, 4) + np.array([4], dtype="<u4").tobytes() + np.array([1], dtype="<f4").tobytes(), "below 4"),
    "sparse order": (head(wire.SPARSE, 4) + np.array([2, 1], dtype="<u4").tobytes() + np.array([1, 1], dtype="<f4").tobytes(), "increasing"),
    "sparse inf": (head(wire.SPARSE, 4) + np.array([1], dtype="<u4").tobytes() + np.array([np.inf], dtype="<f4").tobytes(), "NaN or Inf"),
    "sparse many": (head(wire.SPARSE, 4) + b"\x00" * 40, "at most 4 entries"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_blob_is_refused_naming_the_peer(case: str) -> None:
    blob, why = HOSTILE[case]
    with pytest.raises(ProtocolError) as err:
        wire.decode(blob, peer="12D3KooWliar", length=4, max_length=4)
    assert err.value.peer == "12D3KooWliar" and why in err.value.reason, err.value.reason


def test_a_blob_longer_than_its_bound_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ProtocolError, match="exceeds the bound"):
        wire.decode(head(wire.DENSE, 1 << 31), peer="p", length=None, max_length=1000)


# -- error feedback --------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["int8", "topk:0.05", "topk:0.3"]), steps=st.integers(1, 12), seed=st.integers(0, 1000),
       num_parts=st.integers(1, 4))
def test_the_running_sum_of_contributions_tracks_the_running_sum_of_gradients(name: str, steps: int, seed: int, num_parts: int) -> None:
    codec = slice_codec(parse_sync_compression(name))
    assert codec is not None
    comp = SliceCompressor(codec)
    gen = torch.Generator().manual_seed(seed)
    bounds = part_bounds(257, num_parts)
    total_in, total_sent = torch.zeros(257, dtype=torch.float64), torch.zeros(257, dtype=torch.float64)
    for t in range(steps):
        g = torch.randn(257, generator=gen)
        comp.begin(t)
        sent = comp.contribution(t, g, bounds)
        assert torch.equal(codec.contributions(sent, bounds), sent), "what is sent is the codec's own values"
        comp.commit(t)
        total_in += g.double()
        total_sent += sent.double()
    residual = comp.feedback.residual
    assert residual is not None
    # sent_1 + ... + sent_t + e_t = x_1 + ... + x_t, up to float32 rounding of each addition.
    torch.testing.assert_close(total_sent + residual.double(), total_in, rtol=0, atol=1e-4 * steps)


def test_a_failed_or_redone_attempt_never_counts_its_feedback_and_a_reset_forgets_it() -> None:
    fb = ErrorFeedback()
    x = torch.ones(3)
    assert torch.equal(fb.corrected(x), x)
    fb.stage(0, torch.full((3,), 0.5))
    assert fb.commit(0) and torch.equal(fb.corrected(x), torch.full((3,), 1.5))
    # Step 1, revision 1: staged, but the round failed; revision 2 stages anew, from the same residual.
    fb.stage(1, torch.full((3,), 9.0))
    assert torch.equal(fb.corrected(x), torch.full((3,), 1.5)), "a staged residual is not used before it is committed"
    fb.stage(1, torch.full((3,), 0.25))
    assert fb.commit(1) and torch.equal(fb.residual, torch.full((3,), 0.25))
    # Step 2 is applied with no update (lost): nothing staged for it commits.
    fb.stage(2, torch.full((3,), 7.0))
    assert not fb.commit(3) and torch.equal(fb.residual, torch.full((3,), 0.25))
    # A replica that sent nothing (weight 0) keeps its residual.
    fb.stage(4, None)
    assert fb.commit(4) and torch.equal(fb.residual, torch.full((3,), 0.25))
    fb.reset()
    assert fb.residual is None and not fb.commit(4)
    fb.stage(5, torch.ones(3))
    fb.commit(5)
    with pytest.raises(ValueError, match="error feedback holds"):
        fb.corrected(torch.ones(4))


def test_an_attempt_restarts_from_the_committed_residual() -> None:
    codec = slice_codec(parse_sync_compression("topk:0.1"))
    assert codec is not None
    comp = SliceCompressor(codec)
    g = torch.arange(1.0, 21.0)
    comp.begin(0)
    first = comp.contribution(0, g, [(0, 20)])
    comp.begin(0)  # the round failed: the step is averaged again at the next revision
    again = comp.contribution(0, g, [(0, 20)])
    assert torch.equal(first, again), "the redo starts from the same committed residual"
    comp.commit(0)
    assert torch.equal(comp.feedback.residual, g - again)
