"""Tensors on the wire: a :class:`TensorFrame` is dtype, shape, codec name and raw bytes.

The frame itself, its limits and its header checks live in :mod:`protolearn.protocol.frames`
(no torch, so the transport and the coordinator start fast) and are re-exported here; this module
converts between frames and torch tensors. Tensors are never pickled or ``torch.load``ed. A frame
is checked against :class:`TensorLimits` and against what the receiver expects (dtype, shape,
finiteness) *before* any tensor is built from it, and the byte count must match the shape exactly. Codecs (:mod:`protolearn.protocol.codecs`)
produce and consume frames; the ``none`` codec is the raw form implemented here.
"""

from __future__ import annotations

import torch

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import DEFAULT_LIMITS, DTYPE_SIZES, MAX_DIMS, TensorFrame, TensorLimits, check_frame_header

__all__ = [
    "DEFAULT_LIMITS", "DTYPES", "DTYPE_NAMES", "MAX_DIMS", "TensorFrame", "TensorLimits", "check_header", "from_frame", "to_frame",
]

# Wire names of the dtypes we accept (the keys of frames.DTYPE_SIZES) as torch dtypes.
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


def check_header(
    frame: TensorFrame,
    *,
    peer: str,
    limits: TensorLimits = DEFAULT_LIMITS,
    dtype: torch.dtype | None = None,
    shape: list[int] | tuple[int, ...] | None = None,
) -> torch.dtype:
    """Validate a frame's dtype and shape against limits and expectations; return its torch dtype.

    See :func:`protolearn.protocol.frames.check_frame_header`, which does the checks on dtype names.
    """
    expected = None if dtype is None else DTYPE_NAMES.get(dtype, str(dtype))
    check_frame_header(frame, peer=peer, limits=limits, dtype=expected, shape=shape)
    return DTYPES[frame.dtype]


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
    expected = frame.numel() * DTYPE_SIZES[frame.dtype]
    if len(frame.data) != expected or frame.aux:
        raise ProtocolError(peer, f"tensor payload is {len(frame.data)} bytes, shape {frame.shape} {frame.dtype} needs {expected}")
    if expected == 0:
        t = torch.empty(frame.shape, dtype=want)
    else:
        # bytearray gives a writable buffer, so the tensor owns memory that torch may modify. A received
        # bulk-lane payload is a bytearray already (the receiver's own buffer): the tensor shares it, no copy.
        buf = frame.data if isinstance(frame.data, bytearray) else bytearray(frame.data)
        t = torch.frombuffer(buf, dtype=want).reshape(frame.shape)
    # amax/amin propagate NaN and expose +-Inf without isfinite()'s large bool temporary (~20x faster).
    if require_finite and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin())):
        raise ProtocolError(peer, "tensor contains NaN or Inf")
    return t
