"""A collective part's frame header is checked before its payload is read: raw float32 of the part's
length, or a compressed blob within its bound, never larger than the stage allows; and what arrives
decodes to the float32 values that were sent."""

from __future__ import annotations

import pytest
import torch
import trio

from protolearn.node import part_frames
from protolearn.protocol.errors import ProtocolError, TooLarge
from protolearn.protocol.sync_compression import slice_codec, wire
from protolearn.protocol.transport import TensorHeader
from protolearn.sync_spec import parse_sync_compression


def header(dtype: str, shape: list[int], data_bytes: int) -> TensorHeader:
    return TensorHeader(codec="none", dtype=dtype, shape=shape, data_bytes=data_bytes, aux=b"", bulk=False)


def test_a_part_header_is_refused_before_its_payload_when_it_cannot_be_a_part() -> None:
    part_frames.check_header("p", header("float32", [10], 40), 0, 10, 100)
    part_frames.check_header("p", header("uint8", [30], 30), 0, 10, 100)
    part_frames.check_header("p", header("float32", [80], 320), 0, None, 100)  # a round not started here: the stage bounds it
    cases = [
        (header("float32", [11], 44), 10, ProtocolError, "float32 of 10"),
        (header("float32", [200], 800), None, TooLarge, "exceeds this stage's"),
        (header("int32", [10], 40), 10, ProtocolError, "float32 values or a uint8 blob"),
        (header("uint8", [2, 5], 10), 10, ProtocolError, "float32 values or a uint8 blob"),
        (header("uint8", [wire.max_bytes(10) + 1], wire.max_bytes(10) + 1), 10, TooLarge, "exceeds its bound"),
        (header("uint8", [wire.max_bytes(100) + 1], wire.max_bytes(100) + 1), None, TooLarge, "exceeds its bound"),
    ]
    for h, length, err, why in cases:
        with pytest.raises(err, match=why) as got:
            part_frames.check_header("12D3KooWx", h, 0, length, 100)
        assert got.value.peer == "12D3KooWx"


@pytest.mark.parametrize("compression", ["none", "int8", "topk:0.1"])
def test_a_part_arrives_as_the_values_it_was_sent_with(compression: str) -> None:
    codec = slice_codec(parse_sync_compression(compression))
    part = torch.randn(300, generator=torch.Generator().manual_seed(0))
    if codec is not None:
        part = codec.contribution(part)

    async def main() -> torch.Tensor:
        frame = await part_frames.frame_of(codec, part)
        assert frame.dtype == ("float32" if codec is None else "uint8")
        return await part_frames.values("p", frame, 300, 1000)

    assert torch.equal(trio.run(main), part)
