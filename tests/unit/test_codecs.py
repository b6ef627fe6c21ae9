"""Activation/gradient codecs: round trips with per-codec error bounds, topk error feedback, honest
stats, and decode's refusal of every malformed frame with a ProtocolError naming the peer."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protolearn.codec_spec import CODECS
from protolearn.errors import ConfigError
from protolearn.protocol.codecs import (
    MAX_INT8_SCALE,
    REGISTRY,
    CodecContext,
    CodecSpecError,
    TopKEncoder,
    decode,
    make_encoder,
    parse_codec_spec,
)
from protolearn.protocol.errors import ProtocolError, TooLarge
from protolearn.protocol.tensors import TensorFrame, TensorLimits

PEER = "12D3KooWCodecPeer"
SPECS = ["none", "fp16", "bf16", "int8", "topk", "topk:0.3", "topk:1.0"]

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3)
seeds = st.integers(0, 2**31 - 1)
scales = st.sampled_from([1e-6, 1e-2, 1.0, 100.0, 1e4])


def _randn(shape: list[int], seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _roundtrip(spec: str, x: torch.Tensor, **kw: object) -> tuple[torch.Tensor, TensorFrame]:
    frame, _ = make_encoder(spec).encode(x)
    # Through the real envelope, as on a stream: the frame's fields survive msgpack exactly.
    carried = TensorFrame.model_validate(msgpack.unpackb(msgpack.packb(frame.model_dump(), use_bin_type=True)))
    assert carried == frame
    return decode(carried, peer=PEER, shape=list(x.shape), dtype=x.dtype, **kw), frame  # type: ignore[arg-type]


# --- round trips and error bounds ---


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), shape=shapes, seed=seeds, scale=scales, dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_every_codec_round_trips_shape_dtype_and_reports_its_cost(spec: str, shape: list[int], seed: int, scale: float, dtype: torch.dtype) -> None:
    x = _randn(shape, seed, min(scale, 100.0), dtype)
    frame, stats = make_encoder(spec).encode(x)
    y = decode(frame, peer=PEER, shape=shape, dtype=dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert stats.raw_bytes == x.numel() * x.element_size()
    assert stats.wire_bytes == len(frame.data) + len(frame.aux)
    # rel_error is what the receiver really gets: ||x - decode(encode(x))|| / ||x||
    norm = float(x.float().norm())
    want = float((x.float() - y.float()).norm()) / norm if norm else 0.0
    assert stats.rel_error == pytest.approx(want, rel=1e-3, abs=1e-6)


@settings(max_examples=50, deadline=None)
@given(shape=shapes, seed=seeds)
def test_none_is_bit_exact_even_for_nan_payloads(shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32).view(torch.float32)
    y, frame = _roundtrip("none", x, require_finite=False)
    assert frame.codec == "none"
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize(("spec", "narrow"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds, data=st.data())
def test_cast_codecs_are_exact_on_representable_values_and_round_to_nearest_otherwise(spec: str, narrow: torch.dtype, shape: list[int], seed: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(seed)
    # Every finite bit pattern of the narrow type, subnormals and signed zeros included.
    bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(narrow)
    exact = torch.where(torch.isfinite(bits), bits, torch.zeros((), dtype=narrow)).float()
    y, frame = _roundtrip(spec, exact)
    assert len(frame.data) == 2 * exact.numel()
    assert torch.equal(y.view(torch.int32), exact.view(torch.int32))  # bit-exact, -0.0 included
    x = _randn(shape, seed, data.draw(scales))
    assert torch.equal(_roundtrip(spec, x)[0], x.to(narrow).float())


@pytest.mark.parametrize("dist", ["normal", "spiky", "uniform", "tiny"])
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 300), seed=seeds)
def test_int8_error_is_within_one_percent_of_each_rows_absmax(dist: str, rows: int, cols: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = {
        "normal": lambda: torch.randn(rows, cols, generator=g),
        "spiky": lambda: torch.randn(rows, cols, generator=g) ** 5,
        "uniform": lambda: torch.rand(rows, cols, generator=g) * 1e3 - 500,
        "tiny": lambda: torch.randn(rows, cols, generator=g) * 1e-30,
    }[dist]()
    y, frame = _roundtrip("int8", x)
    assert len(frame.data) == rows * cols and len(frame.aux) == 4 * rows
    absmax = x.abs().amax(dim=1)
    err = (x - y).abs().amax(dim=1)
    # Rounding to the nearest of 255 levels: at most half a step, absmax / 254 (0.4% < 1%).
    assert bool((err <= absmax / 254 * (1 + 1e-5) + 1e-38).all())
    assert bool((err <= 0.01 * absmax + 1e-38).all())


def test_int8_relative_error_on_a_realistic_activation_is_under_one_percent() -> None:
    x = _randn([64, 4096], 0)
    frame, stats = make_encoder("int8").encode(x)
    assert stats.rel_error < 0.01 and stats.ratio < 0.26
    assert stats.wire_bytes == 64 * 4096 + 64 * 4


def test_int8_rows_are_all_dims_but_the_last() -> None:
    x = torch.zeros(2, 3, 5)
    x[1, 2, 0] = 1000.0  # one huge row must not cost the others their precision
    x[0, 0] = torch.linspace(-1, 1, 5)
    y, frame = _roundtrip("int8", x)
    assert len(frame.aux) == 4 * 6
    assert float((y[0, 0] - x[0, 0]).abs().max()) <= 1 / 254 + 1e-7
    assert float(y[1, 2, 0]) == 1000.0


def test_zero_dim_and_empty_tensors_round_trip_in_every_codec() -> None:
    for spec in SPECS:
        for x in (torch.tensor(3.5), torch.zeros(0, 4), torch.zeros(4, 0), torch.zeros(3, 3)):
            y, _ = _roundtrip(spec, x)
            assert y.shape == x.shape
            assert torch.equal(y, x) if x.numel() != 1 or spec != "int8" else float(y) == pytest.approx(3.5), spec


# --- topk ---


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=2), fraction=st.sampled_from([0.01, 0.1, 0.5]), seed=seeds)
def test_topk_first_send_is_exactly_the_k_largest_magnitudes(shape: list[int], fraction: float, seed: int) -> None:
    x = _randn(shape, seed)
    y, frame = _roundtrip(f"topk:{fraction}", x)
    k = math.ceil(fraction * x.numel())
    assert frame.codec == f"topk:{fraction}" and len(frame.data) == 4 * k
    sent = y.reshape(-1) != 0
    assert int(sent.sum()) == k
    assert torch.equal(y.reshape(-1)[sent], x.reshape(-1)[sent])
    # nothing left behind is larger than anything sent
    if bool((~sent).any()):
        assert float(x.reshape(-1)[~sent].abs().max()) <= float(x.reshape(-1)[sent].abs().min())


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 64), min_size=1, max_size=2), fraction=st.sampled_from([0.01, 0.05, 0.2]), steps=st.integers(1, 40), seed=seeds)
def test_topk_error_feedback_sends_the_sum_of_its_inputs(shape: list[int], fraction: float, steps: int, seed: int) -> None:
    encoder = make_encoder(f"topk:{fraction}")
    assert isinstance(encoder, TopKEncoder)
    total_in = torch.zeros(shape, dtype=torch.float64)
    total_sent = torch.zeros(shape, dtype=torch.float64)
    for step in range(steps):
        x = _randn(shape, seed + step)
        frame, _ = encoder.encode(x)
        total_in += x.double()
        total_sent += decode(frame, peer=PEER, shape=shape).double()
    residual = encoder.residual(shape)
    assert residual is not None
    torch.testing.assert_close(total_sent + residual.double(), total_in, rtol=1e-5, atol=1e-5)


def test_topk_on_a_large_gradient_matches_a_full_sort_and_drains_its_residual() -> None:
    x = _randn([128, 1024], 1)  # large enough for the sampled-threshold path
    encoder = TopKEncoder(parse_codec_spec("topk:0.05"))
    frame, stats = encoder.encode(x)
    y = decode(frame, peer=PEER, shape=[128, 1024])
    k = math.ceil(0.05 * x.numel())
    expected = torch.topk(x.reshape(-1).abs(), k).indices.sort().values
    assert torch.equal(torch.nonzero(y.reshape(-1)).squeeze(1), expected)
    assert stats.ratio == pytest.approx(0.1, rel=1e-3)
    # With zero input afterwards, error feedback flushes what was held back, largest first.
    zeros = torch.zeros_like(x)
    for _ in range(20):
        encoder.encode(zeros)
    residual = encoder.residual([128, 1024])
    assert residual is not None and float(residual.abs().max()) == 0.0


def test_topk_keeps_one_residual_per_shape_and_reset_forgets_them() -> None:
    encoder = TopKEncoder(parse_codec_spec("topk:0.1"))
    encoder.encode(_randn([10, 10], 0))
    encoder.encode(_randn([3, 7], 1))
    assert encoder.residual([10, 10]) is not None and encoder.residual([3, 7]) is not None
    encoder.reset()
    assert encoder.residual([10, 10]) is None


# --- specs and encoder refusals ---


def test_codec_specs_parse_and_bad_ones_say_what_is_allowed() -> None:
    assert str(parse_codec_spec("topk")) == "topk:0.05"
    assert parse_codec_spec("topk:0.25").fraction == 0.25
    assert str(parse_codec_spec("int8")) == "int8"
    for bad in ["gzip", "", "topk:0", "topk:1.5", "topk:nan", "topk:abc", "int8:3", "topk:" + "1" * 40, "TOPK"]:
        with pytest.raises(CodecSpecError) as info:
            make_encoder(bad)
        assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
        text = str(info.value)
        assert "\n" not in text and text.startswith("codec=") and "topk" in text


def test_the_registry_has_one_encoder_for_every_name_of_the_grammar() -> None:
    assert set(REGISTRY) == set(CODECS)
    for name in CODECS:
        assert make_encoder(name).spec == parse_codec_spec(name)


def test_fp16_refuses_values_it_would_turn_into_inf() -> None:
    make_encoder("fp16").encode(torch.tensor([65519.0, -65519.0]))  # rounds to the largest finite fp16
    with pytest.raises(ProtocolError) as info:
        make_encoder("fp16").encode(torch.tensor([1.0, 65520.0]))
    assert info.value.peer == "local" and "bf16" in info.value.reason
    frame, _ = make_encoder("bf16").encode(torch.tensor([1.0, 1e30]))
    assert float(decode(frame, peer=PEER, shape=[2])[1]) == pytest.approx(1e30, rel=1e-2)


@pytest.mark.parametrize("spec", ["int8", "topk"])
def test_lossy_stateful_codecs_refuse_nan_at_the_sender(spec: str) -> None:
    with pytest.raises(ProtocolError) as info:
        make_encoder(spec).encode(torch.tensor([1.0, math.nan]))
    assert info.value.peer == "local" and "NaN" in info.value.reason


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "topk"])
def test_lossy_codecs_encode_float_tensors_only(spec: str) -> None:
    with pytest.raises(ProtocolError) as info:
        make_encoder(spec).encode(torch.arange(4))
    assert "float" in info.value.reason


def test_codec_context_is_accepted_for_future_codecs() -> None:
    ctx = CodecContext(token_ids=torch.zeros(1, 4, dtype=torch.int64))
    frame, _ = make_encoder("fp16").encode(torch.ones(2), context=ctx)
    assert torch.equal(decode(frame, peer=PEER, shape=[2], context=ctx), torch.ones(2))


# --- hostile frames ---


def _f(codec: str, shape: list[int], data: bytes, aux: bytes = b"", dtype: str = "float32") -> TensorFrame:
    return TensorFrame(codec=codec, dtype=dtype, shape=shape, data=data, aux=aux)


def _f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


def _i32(*values: int) -> bytes:
    return torch.tensor(values, dtype=torch.int32).numpy().tobytes()


@pytest.mark.parametrize(
    ("frame", "kwargs", "words"),
    [
        (_f("gzip", [2], bytes(8)), {}, "frame codec='gzip' is unknown"),
        (_f("topk:2", [2], bytes(8)), {}, "frame codec='topk:2': the topk fraction"),
        (_f("topk:" + "1" * 40, [2], bytes(8)), {}, "longer than 32 characters"),
        (_f("fp16", [2], bytes(8), dtype="int32"), {"dtype": None}, "carries float tensors"),
        (_f("fp16", [2], bytes(4), dtype="float16"), {}, "dtype float16 but float32 was expected"),
        (_f("fp16", [2], bytes(4)), {"shape": [3]}, "shape [2] but [3] was expected"),
        (_f("fp16", [2], bytes(3)), {}, "needs 4+0 bytes, got 3+0"),
        (_f("fp16", [2], bytes(4), b"\x00"), {}, "needs 4+0 bytes"),
        (_f("bf16", [2], bytes(5)), {}, "needs 4+0 bytes"),
        (_f("int8", [2, 3], bytes(6), bytes(4)), {}, "needs 6+8 bytes"),
        (_f("int8", [2, 3], bytes(6), _f32(1.0, math.nan)), {}, "row scales"),
        (_f("int8", [2, 3], bytes(6), _f32(1.0, math.inf)), {}, "row scales"),
        (_f("int8", [2, 3], bytes(6), _f32(1.0, -1.0)), {}, "row scales"),
        (_f("int8", [2, 3], bytes(6), _f32(1.0, MAX_INT8_SCALE * 2)), {}, "row scales"),
        (_f("topk:0.5", [4], _f32(1, 2), _i32(0)), {}, "needs 8+8 bytes"),
        (_f("topk:0.5", [4], _f32(1, 2), _i32(0, 4)), {}, "within [0, 4)"),
        (_f("topk:0.5", [4], _f32(1, 2), _i32(-1, 2)), {}, "within [0, 4)"),
        (_f("topk:0.5", [4], _f32(1, 2), _i32(2, 2)), {}, "strictly increasing"),
        (_f("topk:0.5", [4], _f32(1, 2), _i32(3, 1)), {}, "strictly increasing"),
        (_f("topk:0.5", [4], _f32(1, math.nan), _i32(0, 1)), {}, "NaN or Inf"),
        (_f("fp16", [2], torch.tensor([1.0, math.inf], dtype=torch.float16).numpy().tobytes()), {}, "NaN or Inf"),
        (_f("none", [2], _f32(math.nan, 0)), {}, "NaN or Inf"),
        (_f("fp16", [1] * 9, bytes(2)), {}, "invalid tensor shape"),
        (_f("int8", [-1, 4], b""), {}, "invalid tensor shape"),
    ],
)
def test_malformed_codec_frames_are_refused_naming_the_peer(frame: TensorFrame, kwargs: dict, words: str) -> None:
    args = {"shape": None, **kwargs}
    with pytest.raises(ProtocolError) as info:
        decode(frame, peer=PEER, **args)
    assert info.value.peer == PEER and words in info.value.reason


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "topk:0.01"])
def test_huge_declared_tensors_with_tiny_payloads_are_refused_before_allocating(codec: str) -> None:
    for shape in ([2**20, 2**20], [2**40], [0, 2**40, 2**40]):
        with pytest.raises(TooLarge) as info:
            decode(_f(codec, shape, bytes(8), bytes(8)), peer=PEER, shape=None)
        assert info.value.peer == PEER
    with pytest.raises(TooLarge):
        decode(_f(codec, [64, 64], bytes(8)), peer=PEER, shape=None, limits=TensorLimits(max_elements=1024))


def test_non_finite_values_pass_when_the_caller_allows_them() -> None:
    frame = _f("topk:0.5", [4], _f32(1, math.inf), _i32(0, 3))
    y = decode(frame, peer=PEER, shape=[4], require_finite=False)
    assert y[0] == 1 and math.isinf(float(y[3])) and float(y[1:3].abs().sum()) == 0


@settings(max_examples=300, deadline=None)
@given(
    codec=st.sampled_from(["none", "fp16", "bf16", "int8", "topk:0.5", "topk:0.05", "topk:x", "int4"]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8", "int64", "complex64"]),
    shape=st.lists(st.integers(-2, 9), max_size=4) | st.lists(st.integers(0, 2**64 - 1), max_size=9),
    data=st.binary(max_size=96),
    aux=st.binary(max_size=48),
)
def test_arbitrary_frames_only_ever_raise_protocol_error(codec: str, dtype: str, shape: list[int], data: bytes, aux: bytes) -> None:
    frame = TensorFrame(codec=codec, dtype=dtype, shape=shape, data=data, aux=aux)
    try:
        y = decode(frame, peer=PEER, shape=None, dtype=None)
    except ProtocolError as err:
        assert err.peer == PEER
    else:
        assert list(y.shape) == shape and bool(torch.isfinite(y.float()).all())
