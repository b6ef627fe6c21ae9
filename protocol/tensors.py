"""Tensors on the wire: a :class:`TensorFrame` is dtype, shape, codec name and raw bytes.

Tensors are never pickled or ``torch.load``ed. A frame is checked against :class:`TensorLimits`
and against what the receiver expects (dtype, shape, finiteness) *before* any tensor is built from
it, and the byte count must match the shape exactly. Codecs (:mod:`protolearn.protocol.codecs`)
produce and consume frames; the ``none`` codec is the raw form implemented here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from protolearn.protocol.errors import ProtocolError, TooLarge

# Wire names of the dtypes we accept. Anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
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


def check_header(
    frame: TensorFrame,
    *,
    peer: str,
    limits: TensorLimits = DEFAULT_LIMITS,
    dtype: torch.dtype | None = None,
    shape: list[int] | tuple[int, ...] | None = None,
) -> torch.dtype:
    """Validate a frame's dtype and shape against limits and expectations; return its torch dtype."""
    if frame.dtype not in DTYPES:
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
    want = DTYPES[frame.dtype]
    if dtype is not None and want != dtype:
        raise ProtocolError(peer, f"tensor dtype {frame.dtype} but {DTYPE_NAMES.get(dtype, dtype)} was expected")
    if shape is not None and list(frame.shape) != list(shape):
        raise ProtocolError(peer, f"tensor shape {frame.shape} but {list(shape)} was expected")
    return want


def to_frame(t: torch.Tensor) -> TensorFrame:
    """Encode ``t`` raw (codec ``none``): its exact bytes, moved to CPU and made contiguous."""
    if t.dtype not in DTYPE_NAMES:
        raise ProtocolError("local", f"cannot send tensors of dtype {t.dtype}")
    t = t.detach().to("cpu").contiguous()
    # A uint8 view of the storage gives the raw bytes for every dtype, bfloat16 included (numpy has none).
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return TensorFrame(codec="none", dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=raw)


def from_frame(
    frame: TensorFrame,
    *,
    peer: str,
    limits: TensorLimits = DEFAULT_LIMITS,
    dtype: torch.dtype | None = None,
    shape: list[int] | tuple[int, ...] | None = None,
    require_finite: bool = False,
) -> torch.Tensor:
    """Decode a ``none``-codec frame into a new tensor, after every check has passed."""
    if frame.codec != "none":
        raise ProtocolError(peer, f"expected a raw tensor frame, got codec {frame.codec[:32]!r}")
    want = check_header(frame, peer=peer, limits=limits, dtype=dtype, shape=shape)
    expected = frame.numel() * torch.empty((), dtype=want).element_size()
    if len(frame.data) != expected or frame.aux:
        raise ProtocolError(peer, f"tensor payload is {len(frame.data)} bytes, shape {frame.shape} {frame.dtype} needs {expected}")
    if expected == 0:
        t = torch.empty(frame.shape, dtype=want)
    else:
        # bytearray gives a writable buffer, so the tensor owns memory that torch may modify.
        t = torch.frombuffer(bytearray(frame.data), dtype=want).reshape(frame.shape)
    if require_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ProtocolError(peer, "tensor contains NaN or Inf")
    return t
