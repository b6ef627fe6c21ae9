"""How a collective part travels as a tensor frame: raw float32, or the blob of a compressed round.

A round without a slice compression sends each part as a raw float32 frame (a view of the part's
memory, :func:`~protolearn.node.finished_rounds.borrowed_frame`). A compressed round
(:mod:`protolearn.protocol.sync_compression`) sends the part's lossless blob
(:mod:`~protolearn.protocol.sync_compression.wire`) as a ``uint8`` frame. The receiver checks the frame's
header before a payload byte is read (:func:`check_header`: a float32 part of the part's length, or a
blob within its bound; either no larger than the stage allows) and decodes what arrived to the float32
values the round works on (:func:`values`), blobs in a worker thread. Encoding (:func:`frame_of`) also
runs in a worker thread: it reads every value.
"""

from __future__ import annotations

import torch
import trio
from protolearn.node.finished_rounds import borrowed_frame
from protolearn.protocol.errors import ProtocolError, TooLarge
from protolearn.protocol.sync_compression import SliceCodec, wire
from protolearn.protocol.tensors import TensorFrame, TensorLimits, from_frame
from protolearn.protocol.transport import TensorHeader


def limits(numel: int) -> TensorLimits:
    """What any part frame of a stage of ``numel`` values may be (its header is checked further by :func:`check_header`)."""
    blob = wire.max_bytes(numel)
    return TensorLimits(max_elements=max(1, numel, blob), max_bytes=max(4, 4 * numel, blob))


def check_header(peer: str, header: TensorHeader, part: int, length: int | None, numel: int) -> None:
    """Refuse a part frame before its payload is read: float32 of ``length`` values (when the round is known
    here), or a uint8 blob within the bound of ``length`` (else of the stage's ``numel``)."""
    if header.dtype == "float32":
        if length is not None and header.shape != [length]:
            raise ProtocolError(peer, f"collective part {part} must be float32 of {length} elements, got shape {header.shape}")
        if header.data_bytes > 4 * numel:
            raise TooLarge(peer, f"collective part of {header.data_bytes} bytes exceeds this stage's {4 * numel}")
    elif header.dtype != "uint8" or len(header.shape) != 1:
        raise ProtocolError(peer, f"collective part must be float32 values or a uint8 blob, got {header.dtype} {header.shape}")
    elif header.data_bytes > wire.max_bytes(numel if length is None else length):
        raise TooLarge(peer, f"compressed collective part of {header.data_bytes} bytes exceeds its bound")


async def values(peer: str, frame: TensorFrame, length: int | None, numel: int) -> torch.Tensor:
    """The float32 values (flat) of a checked part frame; raises ProtocolError naming ``peer``."""
    if frame.dtype == "float32":
        data = from_frame(frame, peer=peer, dtype=torch.float32, limits=TensorLimits(max(1, numel), max(4, 4 * numel)), require_finite=True)
        if data.dim() != 1:
            raise ProtocolError(peer, f"collective part must be a flat vector, got shape {list(data.shape)}")
        return data
    return await trio.to_thread.run_sync(lambda: wire.decode(frame.data, peer=peer, length=length, max_length=numel))


async def frame_of(codec: SliceCodec | None, data: torch.Tensor) -> TensorFrame:
    """The frame that carries part ``data`` in a round with ``codec`` (None: raw float32)."""
    if codec is None:
        return borrowed_frame(data)
    blob = await trio.to_thread.run_sync(codec.encode, data)
    return TensorFrame.model_construct(codec="none", dtype="uint8", shape=[len(blob)], data=blob, aux=b"")
