"""The ``int8`` codec: per-row absmax quantisation.

Layout: ``data`` holds numel int8 values, row-major (R, C); ``aux`` holds R float32 scales, and row r
is rebuilt as ``q[r] * scale[r]``. A row is everything but the last dimension: C = ``shape[-1]`` and
R = numel / C (a 0-dim tensor is one row of one). Every element is within ``scale / 2`` of its value.
The decoder refuses a scale that is negative, NaN, or so large that ``128 * scale`` overflows float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protolearn.codec_spec import CodecSpec
from protolearn.protocol.codecs.codec import (
    Codec,
    CodecContext,
    EncodeStats,
    all_finite,
    buffer,
    expect_sizes,
    float_header,
    float_input,
    raw,
    rel_error,
)
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import DTYPE_NAMES, TensorFrame, TensorLimits

# int8 scales above this could overflow float32 once multiplied by |q| <= 128; a sender never needs them.
MAX_INT8_SCALE = torch.finfo(torch.float32).max / 128


def rows(shape: Sequence[int]) -> tuple[int, int]:
    """(R, C) of the int8 row layout: C is the last dimension, a 0-dim tensor is one row of one."""
    if not shape:
        return 1, 1
    r = 1
    for d in shape[:-1]:
        r *= d
    return r, shape[-1]


class Int8Encoder:
    """Per-row absmax: scale = max|row| / 127, q = round(x / scale); every element is within scale / 2."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = float_input(t, "int8")
        if not all_finite(x):
            raise ProtocolError("local", "int8 cannot encode NaN or Inf (its row scale would be lost)")
        r, c = rows(x.shape)
        xs = x.float().reshape(r, c)  # (R, C)
        if xs.numel():
            absmax = torch.maximum(xs.amax(dim=1), -xs.amin(dim=1))  # (R,), no |x| temporary
        else:
            absmax = torch.zeros(r, device=xs.device)
        scale = absmax / 127.0  # float32 absmax / 127 is always finite
        inv = torch.where(scale > 0, 1.0 / scale, 0.0).unsqueeze(1)  # (R, 1); an all-zero row stays 0
        z = xs * inv  # (R, C), in units of the row's step
        q = z.round().clamp_(-127, 127)  # (R, C)
        if x.dtype == torch.float32:
            # x - q * scale == scale * (z - q), so the error needs no rebuilt copy of x
            err = float(torch.linalg.vector_norm(torch.linalg.vector_norm(z.sub_(q), dim=1) * scale)) if xs.numel() else 0.0
        else:  # the receiver also rounds q * scale to x's dtype; measure exactly that
            err = float(torch.dist(xs, (q * scale.unsqueeze(1)).to(x.dtype).float())) if xs.numel() else 0.0
        q = q.to(torch.int8)
        frame = TensorFrame(codec="int8", dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=raw(q), aux=raw(scale))
        raw_bytes = x.numel() * x.element_size()
        return frame, EncodeStats("int8", raw_bytes, frame.nbytes(), rel_error(xs, err))


def decode_int8(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
    limits: TensorLimits, context: CodecContext | None,
) -> torch.Tensor:
    out_dtype = float_header(frame, spec, peer=peer, shape=shape, dtype=dtype, limits=limits)
    r, c = rows(frame.shape)
    expect_sizes(frame, peer, frame.numel(), 4 * r)
    scale = buffer(frame.aux, torch.float32)  # (R,)
    if r and not bool(((scale >= 0) & (scale <= MAX_INT8_SCALE)).all()):  # NaN fails both comparisons
        raise ProtocolError(peer, f"int8 row scales must be finite, >= 0 and <= {MAX_INT8_SCALE:.3g}")
    q = buffer(frame.data, torch.int8).reshape(r, c)  # (R, C)
    return (q.float() * scale.unsqueeze(1)).to(out_dtype).reshape(frame.shape)


INT8 = Codec(Int8Encoder, decode_int8)
