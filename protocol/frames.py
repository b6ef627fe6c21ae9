"""Tensor frames as they travel, without torch: :class:`TensorFrame`, :class:`TensorLimits` and the header check.

A frame is dtype name, shape, codec name and bytes. Everything that can be checked about a frame
before a tensor is built (dtype known, shape sane, element and byte counts within limits, the
expected dtype and shape) is checked here on names and integers, so the transport and the
coordinator, which carry no tensors, never import torch (it costs seconds at startup). The torch
side (dtype objects, ``to_frame``/``from_frame``) is :mod:`protolearn.protocol.tensors`, which
re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from protolearn.protocol.errors import ProtocolError, TooLarge

# Wire names of the dtypes we accept, with their element size in bytes. Anything else is refused.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}
MAX_DIMS = 8


@dataclass(frozen=True)
class TensorLimits:
    """Hard bounds on one tensor frame, checked before allocating."""

    max_elements: int = 64 * 1024 * 1024
    max_bytes: int = 256 * 1024 * 1024


DEFAULT_LIMITS = TensorLimits()


class TensorFrame(BaseModel):
    """One tensor as it travels: ``data`` holds the codec's payload, ``aux`` its side data.

    ``dtype`` and ``shape`` describe the *decoded* tensor. For the ``none`` codec ``data`` is the
    tensor's raw little-endian bytes in C order and ``aux`` is empty.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    SCHEMA: ClassVar[str] = "tensor"

    codec: str
    dtype: str
    shape: list[int]
    data: bytes
    aux: bytes = b""

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        return len(self.data) + len(self.aux)


def check_frame_header(
    frame: TensorFrame,
    *,
    peer: str,
    limits: TensorLimits = DEFAULT_LIMITS,
    dtype: str | None = None,
    shape: list[int] | tuple[int, ...] | None = None,
) -> int:
    """Validate a frame's dtype and shape against limits and the expected dtype name and shape.

    Returns the element size in bytes of the frame's dtype.
    """
    if frame.dtype not in DTYPE_SIZES:
        raise ProtocolError(peer, f"unsupported tensor dtype {frame.dtype[:32]!r}")
    if len(frame.shape) > MAX_DIMS or any(d < 0 for d in frame.shape):
        raise ProtocolError(peer, f"invalid tensor shape {frame.shape[:MAX_DIMS + 1]}")
    n = frame.numel()
    if n > limits.max_elements:
        raise TooLarge(peer, f"tensor of {n} elements exceeds the limit of {limits.max_elements}")
    # A zero dimension makes numel 0, but torch still computes strides from the other dimensions,
    # and a shape like [0, 2**62, 2**62] overflows them (RuntimeError): bound their product too.
    span = 1
    for d in frame.shape:
        span *= max(d, 1)
    if span > limits.max_elements:
        raise TooLarge(peer, f"tensor shape {frame.shape[:MAX_DIMS]} spans more than {limits.max_elements} elements")
    if frame.nbytes() > limits.max_bytes:
        raise TooLarge(peer, f"tensor frame of {frame.nbytes()} bytes exceeds the limit of {limits.max_bytes}")
    if dtype is not None and frame.dtype != dtype:
        raise ProtocolError(peer, f"tensor dtype {frame.dtype} but {dtype} was expected")
    if shape is not None and list(frame.shape) != list(shape):
        raise ProtocolError(peer, f"tensor shape {frame.shape} but {list(shape)} was expected")
    return DTYPE_SIZES[frame.dtype]
