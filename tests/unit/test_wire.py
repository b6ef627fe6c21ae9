"""The msgpack envelope and raw tensor frames: every message round-trips, and hostile bytes only ever
raise ProtocolError naming the peer (DESIGN.md I4)."""

from __future__ import annotations

import enum
import importlib
import math
import pkgutil
import types
import typing
from typing import Annotated, ClassVar, Literal

import annotated_types as at
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import protolearn.protocol
from protolearn.protocol import wire
from protolearn.protocol.errors import ProtocolError, TooLarge
from protolearn.protocol.tensors import MAX_DIMS, TensorFrame, TensorLimits, check_header, from_frame, to_frame
from protolearn.protocol.wire import ErrorReply, Message

PEER = "12D3KooWEvilPeer"


class TensorCarrier(Message):
    """A test-only message that carries a tensor frame, so frames go through the real envelope."""

    KIND: ClassVar[str] = "test.tensor_carrier"
    name: str
    frame: TensorFrame


# Every message kind defined anywhere in protolearn.protocol is registered on import; import them all
# so that a message added later is covered without touching this test.
for _mod in pkgutil.iter_modules(protolearn.protocol.__path__, "protolearn.protocol."):
    importlib.import_module(_mod.name)
KINDS = sorted(Message.registry)


# --- a hypothesis strategy for any strict pydantic model, from its annotations and constraints ---

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


def _constraints(metadata: typing.Iterable[object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(_constraints(m.metadata))
        elif isinstance(m, at.MinLen):
            out["min_len"] = m.min_length
        elif isinstance(m, at.MaxLen):
            out["max_len"] = m.max_length
        elif isinstance(m, at.Ge):
            out["ge"] = m.ge
        elif isinstance(m, at.Gt):
            out["gt"] = m.gt
        elif isinstance(m, at.Le):
            out["le"] = m.le
        elif isinstance(m, at.Lt):
            out["lt"] = m.lt
        elif getattr(m, "allow_inf_nan", None) is not None:
            out["allow_inf_nan"] = m.allow_inf_nan
    return out


def _strategy(tp: object, c: dict[str, object]) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _strategy(args[0], {**c, **_constraints(args[1:])})
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_strategy(a, c) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        lo = max(_INT_MIN, c.get("ge", _INT_MIN), c.get("gt", _INT_MIN - 1) + 1)  # type: ignore[operator]
        hi = min(_INT_MAX, c.get("le", _INT_MAX), c.get("lt", _INT_MAX + 1) - 1)  # type: ignore[operator]
        return st.integers(lo, hi)
    if tp is float:
        finite = c.get("allow_inf_nan", True) is False
        lo, hi = c.get("ge", c.get("gt")), c.get("le", c.get("lt"))
        return st.floats(
            min_value=lo, max_value=hi, exclude_min="gt" in c, exclude_max="lt" in c,
            allow_nan=False, allow_infinity=not finite and lo is None and hi is None,
        )
    if tp in (str, bytes):
        lo = int(c.get("min_len", 0))  # type: ignore[arg-type]
        hi = min(int(c.get("max_len", 40)), lo + 40)  # type: ignore[arg-type]
        return st.text(min_size=lo, max_size=hi) if tp is str else st.binary(min_size=lo, max_size=hi)
    if origin is list:
        lo = int(c.get("min_len", 0))  # type: ignore[arg-type]
        return st.lists(_strategy(args[0], {}), min_size=lo, max_size=min(int(c.get("max_len", 4)), lo + 4))  # type: ignore[arg-type]
    if origin is dict:
        return st.dictionaries(_strategy(args[0], {}), _strategy(args[1], {}), max_size=4)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_strategy(tp)
    return st.from_type(tp)  # type: ignore[arg-type]


def _validated(cls: type[BaseModel]):
    def build(fields: dict) -> BaseModel | None:
        try:
            return cls.model_validate(fields)
        except ValidationError:  # a cross-field validator refused this combination
            return None

    return build


def model_strategy(cls: type[BaseModel]) -> st.SearchStrategy:
    fields = {name: _strategy(f.annotation, _constraints(f.metadata)) for name, f in cls.model_fields.items()}
    return st.fixed_dictionaries(fields).map(_validated(cls)).filter(lambda m: m is not None)


# --- round trips ---


def test_every_message_kind_is_covered() -> None:
    assert "error" in KINDS and TensorCarrier.KIND in KINDS


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_message_round_trips(kind: str, data: st.DataObject) -> None:
    cls = Message.registry[kind]
    msg = data.draw(model_strategy(cls))
    framed = wire.frame(msg)
    n = wire.parse_length(framed[: wire.LENGTH_PREFIX.size], peer=PEER)
    assert n == len(framed) - wire.LENGTH_PREFIX.size
    back = wire.decode(framed[wire.LENGTH_PREFIX.size :], peer=PEER, expect=cls)
    assert type(back) is cls and back == msg


_DTYPE_FOR = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
              "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(_DTYPE_FOR)),
    shape=st.lists(st.integers(0, 5), max_size=4),
    seed=st.integers(0, 2**31),
)
def test_tensor_frames_round_trip_bit_exactly_through_the_envelope(dtype: str, shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Arbitrary bit patterns, NaN payloads included: a raw frame must not touch a single bit.
    bits = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=_DTYPE_FOR[dtype]).element_size(),), generator=g, dtype=torch.uint8)
    t = bits.view(_DTYPE_FOR[dtype]).reshape(shape)
    msg = TensorCarrier(name="x", frame=to_frame(t))
    back = wire.decode(wire.encode(msg), peer=PEER, expect=TensorCarrier)
    assert isinstance(back, TensorCarrier) and back == msg
    out = from_frame(back.frame, peer=PEER, dtype=_DTYPE_FOR[dtype], shape=shape)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


# --- hostile envelopes ---


def _assert_rejected(data: bytes, **kwargs: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.decode(data, peer=PEER, **kwargs)  # type: ignore[arg-type]
    assert info.value.peer == PEER and PEER in str(info.value)
    return info.value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    try:
        wire.decode(data, peer=PEER)
    except ProtocolError as err:
        assert err.peer == PEER


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(_INT_MIN, _INT_MAX) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS) | st.text(max_size=12), version=st.sampled_from([1, 0, 2, -1, "1", None]), body=_msgpack_values)
def test_well_formed_msgpack_with_arbitrary_content_only_raises_protocol_error(kind: str, version: object, body: object) -> None:
    data = msgpack.packb({"v": version, "k": kind, "b": body}, use_bin_type=True)
    try:
        msg = wire.decode(data, peer=PEER)
    except ProtocolError as err:
        assert err.peer == PEER
    else:  # arbitrary content that happens to be a valid message must really be one
        assert isinstance(msg, Message) and version == 1 and msg.KIND == kind


def test_every_truncation_of_a_valid_message_is_rejected() -> None:
    data = wire.encode(ErrorReply(code="busy", reason="queue full, retry in 1 s"))
    for cut in range(len(data)):
        _assert_rejected(data[:cut])


@pytest.mark.parametrize(
    ("envelope", "words"),
    [
        ({"v": 99, "k": "error", "b": {"code": "x", "reason": "y"}}, "unsupported protocol version 99"),
        ({"v": "1", "k": "error", "b": {"code": "x", "reason": "y"}}, "unsupported protocol version"),
        ({"v": 1, "k": "no.such.kind", "b": {}}, "unknown message kind 'no.such.kind'"),
        ({"v": 1, "k": 7, "b": {}}, "kind is not a string"),
        ({"v": 1, "k": "error", "b": [1, 2]}, "body is not a map"),
        ({"v": 1, "k": "error"}, "exactly v, k, b"),
        ({"v": 1, "k": "error", "b": {}, "x": 1}, "exactly v, k, b"),
        ({"v": 1, "k": "error", "b": {"code": 5, "reason": "y"}}, "invalid error: code"),
        ({"v": 1, "k": "error", "b": {"code": b"busy", "reason": "y"}}, "invalid error: code"),
        ({"v": 1, "k": "error", "b": {"code": "x", "reason": "y", "extra": 1}}, "invalid error: extra"),
        ({"v": 1, "k": "error", "b": {"code": "x"}}, "invalid error: reason"),
    ],
)
def test_bad_envelopes_are_rejected_with_the_reason(envelope: object, words: str) -> None:
    err = _assert_rejected(msgpack.packb(envelope, use_bin_type=True))
    assert words in err.reason


def test_tensor_frame_fields_are_type_checked_in_the_envelope() -> None:
    good = TensorCarrier(name="a", frame=to_frame(torch.zeros(2))).model_dump()
    for field, bad in [("shape", ["2"]), ("shape", 2), ("data", "text"), ("dtype", 4), ("codec", None)]:
        body = {**good, "frame": {**good["frame"], field: bad}}
        err = _assert_rejected(msgpack.packb({"v": 1, "k": TensorCarrier.KIND, "b": body}, use_bin_type=True))
        assert f"frame.{field}" in err.reason


def test_unexpected_kind_is_refused_but_an_error_reply_always_passes() -> None:
    data = wire.encode(TensorCarrier(name="a", frame=to_frame(torch.zeros(1))))
    assert "unexpected message kind" in _assert_rejected(data, expect=ErrorReply).reason
    reply = wire.decode(wire.encode(ErrorReply(code="banned", reason="r")), peer=PEER, expect=TensorCarrier)
    assert reply == ErrorReply(code="banned", reason="r")


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 100_000 + b"\xc0",  # arrays nested 100k deep
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion elements in 5 bytes
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4 billion entries
        b"\xc6\xff\xff\xff\xff" + b"x",  # a 4 GiB bin with one byte behind it
        b"\x81\x01\x02",  # a map with an integer key (strict_map_key)
        b"\xc1",  # a reserved type byte
        wire.encode(ErrorReply(code="a", reason="b")) + b"\x00",  # trailing garbage
    ],
)
def test_msgpack_bombs_and_garbage_are_rejected_without_allocating(data: bytes) -> None:
    assert "malformed msgpack" in _assert_rejected(data).reason


def test_length_prefix_is_checked_before_reading_the_body() -> None:
    with pytest.raises(TooLarge) as info:
        wire.parse_length(wire.LENGTH_PREFIX.pack(2**40), peer=PEER)
    assert info.value.peer == PEER and str(2**40) in info.value.reason
    with pytest.raises(TooLarge):
        wire.parse_length(wire.LENGTH_PREFIX.pack(1025), peer=PEER, max_bytes=1024)
    assert wire.parse_length(wire.LENGTH_PREFIX.pack(1024), peer=PEER, max_bytes=1024) == 1024
    for bad in (wire.LENGTH_PREFIX.pack(0), b"\x00\x00\x01", b""):
        with pytest.raises(ProtocolError) as info:
            wire.parse_length(bad, peer=PEER)
        assert info.value.peer == PEER


def test_frame_refuses_to_build_an_oversized_message() -> None:
    msg = ErrorReply(code="x", reason="y" * 2000)
    with pytest.raises(TooLarge) as info:
        wire.frame(msg, max_bytes=1000)
    assert info.value.peer == "local"


# --- hostile raw tensor frames (the codec-level cases are in test_codecs.py) ---


def _frame(**kw: object) -> TensorFrame:
    base: dict[str, object] = {"codec": "none", "dtype": "float32", "shape": [2, 2], "data": bytes(16)}
    return TensorFrame(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("frame", "kwargs", "error", "words"),
    [
        (_frame(dtype="float64", data=bytes(32)), {}, ProtocolError, "unsupported tensor dtype"),
        (_frame(dtype="int32"), {"dtype": torch.float32}, ProtocolError, "dtype int32 but float32 was expected"),
        (_frame(), {"shape": [4]}, ProtocolError, "shape [2, 2] but [4] was expected"),
        (_frame(data=bytes(15)), {}, ProtocolError, "payload is 15 bytes"),
        (_frame(data=bytes(17)), {}, ProtocolError, "payload is 17 bytes"),
        (_frame(aux=b"x"), {}, ProtocolError, "payload"),
        (_frame(shape=[1] * (MAX_DIMS + 1), data=bytes(4)), {}, ProtocolError, "invalid tensor shape"),
        (_frame(shape=[-2, -2]), {}, ProtocolError, "invalid tensor shape"),
        (_frame(shape=[2**31, 2**31], data=b""), {}, TooLarge, "elements exceeds the limit"),
        (_frame(shape=[0, 2**62, 2**62], data=b""), {}, TooLarge, "spans more than"),
        (_frame(shape=[64], data=bytes(256)), {"limits": TensorLimits(max_elements=1000, max_bytes=100)}, TooLarge, "bytes exceeds"),
        (_frame(codec="int8"), {}, ProtocolError, "expected a raw tensor frame"),
    ],
)
def test_bad_raw_frames_are_rejected_before_allocating(frame: TensorFrame, kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        from_frame(frame, peer=PEER, **kwargs)
    assert info.value.peer == PEER and words in info.value.reason


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_raw_tensors_are_refused_when_finite_is_required(value: float) -> None:
    frame = to_frame(torch.tensor([1.0, value]))
    with pytest.raises(ProtocolError) as info:
        from_frame(frame, peer=PEER, require_finite=True)
    assert "NaN or Inf" in info.value.reason and info.value.peer == PEER
    assert from_frame(frame, peer=PEER).shape == (2,)  # allowed when the caller does not require it


def test_check_header_returns_the_torch_dtype() -> None:
    assert check_header(_frame(dtype="bfloat16", data=bytes(8)), peer=PEER) is torch.bfloat16


@pytest.mark.parametrize("kind", ["JoinReply", "Members"])
def test_a_run_toml_over_max_run_toml_is_refused(kind: str) -> None:
    from protolearn.protocol import coordination as cm

    fields = {
        "JoinReply": dict(stage=0, run_hash="h", step=0, rejoined=False, reason="", heartbeat_interval_s=1.0, expiry_s=5.0,
                          lease_s=5.0, bans=[], view_version=0, members=[]),
        "Members": dict(run_hash="h", step=0, members=[]),
    }[kind]
    cls = getattr(cm, kind)
    at_limit = cls(run_toml="#" * cm.MAX_RUN_TOML, **fields)
    assert wire.decode(wire.encode(at_limit), peer=PEER, expect=cls) == at_limit
    body = {**at_limit.model_dump(), "run_toml": "#" * (cm.MAX_RUN_TOML + 1)}
    err = _assert_rejected(msgpack.packb({"v": 1, "k": cls.KIND, "b": body}, use_bin_type=True), expect=cls)
    assert "run_toml" in err.reason
    with pytest.raises(ValidationError):
        cls(run_toml="#" * (cm.MAX_RUN_TOML + 1), **fields)


def test_a_redo_of_a_whole_step_at_the_largest_step_the_run_config_allows_goes_over_the_wire() -> None:
    """Issue 26: a replica whose round failed asks for all its stage's tickets to be redone; with 5,000 tickets per
    step (the simulated 10,000-node swarm) the redo overran the per-request bound of 1,024 and the node crashed.
    The run config bounds a step's tickets, and a redo carries them all."""
    from protolearn.protocol import coordination as cm
    from protolearn.stages.config import RunConfig
    from protolearn.step_limits import MAX_TICKETS_PER_STEP

    redo = cm.Redo(step=3, indices=list(range(MAX_TICKETS_PER_STEP)), reason="round failed", kind="round_failed")
    data = wire.encode(redo)
    assert len(data) < 1024 * 1024
    assert wire.decode(data, peer="p", expect=cm.Redo) == redo
    with pytest.raises(ValidationError, match="microbatches_per_step"):
        RunConfig.model_validate({"batch": {"microbatches_per_step": MAX_TICKETS_PER_STEP + 1}})


def test_repeated_records_encode_as_a_plain_dump_and_each_records_dump_lives_as_long_as_it() -> None:
    """A reply's view entries are dumped once per entry object (wire.dumped); the bytes decode to the same reply."""
    import gc

    from protolearn.protocol import coordination as cm

    members = [cm.MemberView(peer_id=f"12D3KooW{i:040d}", stage=i % 3, addrs=[f"/ip4/10.0.0.{i}/tcp/4001"],
                             state="training", throughput=float(i), queue_len=i) for i in range(5)]
    reply = cm.HeartbeatReply(stage=0, step=3, last_closed=2, bans=[], view_version=7, view_changed=True, members=members,
                              reason="", view_delta=True, removed=["12D3KooWgone"])
    plain = msgpack.packb({"v": wire.WIRE_VERSION, "k": reply.KIND, "b": reply.model_dump()}, use_bin_type=True)
    for _ in range(2):  # the second time from the cached dumps
        data = wire.encode(reply)
        assert msgpack.unpackb(data) == msgpack.unpackb(plain)
        assert wire.decode(data, peer="p", expect=cm.HeartbeatReply) == reply
    assert all(id(m) in wire._DUMPS for m in members)
    assert sum(wire.record_size(m) for m in members) == sum(len(msgpack.packb(m.model_dump())) for m in members)
    keys = [id(m) for m in members]
    del reply, members
    gc.collect()
    assert not any(k in wire._DUMPS for k in keys)
