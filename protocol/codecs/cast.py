"""The ``fp16`` and ``bf16`` codecs: a plain cast to a 16-bit float.

Layout: ``data`` holds numel float16 (or bfloat16) values, C order, little endian; ``aux`` is empty.
The receiver casts them back to ``frame.dtype``. The encoder refuses a finite value that the narrow
type would turn into Inf (a bf16 or int8 codec can carry it); NaN and Inf inputs pass through as they
are, and the receiver's finiteness check names them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protolearn.codec_spec import CodecSpec
from protolearn.protocol.codecs.codec import Codec, CodecContext, EncodeStats, buffer, expect_sizes, float_header, float_input, raw, rel_error
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import DTYPE_NAMES, TensorFrame, TensorLimits


def _wire_dtype(name: str) -> torch.dtype:
    return torch.float16 if name == "fp16" else torch.bfloat16


class CastEncoder:
    """fp16 / bf16: a plain cast, refusing values that the narrow type would turn into Inf."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.wire_dtype = _wire_dtype(spec.name)
        # The smallest magnitude that rounds to Inf: max + half a unit in the last place (a tie rounds
        # to the even neighbour, which is Inf).
        finfo = torch.finfo(self.wire_dtype)
        self.overflow = finfo.max + 2.0 ** math.floor(math.log2(finfo.max)) * finfo.eps / 2

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = float_input(t, self.spec.name)
        if x.numel():
            # Only finite values beyond the narrow type's range turn into Inf; NaN/Inf inputs pass
            # through unchanged and the receiver's finiteness check names them.
            top = float(torch.maximum(x.amax(), -x.amin()))
            if math.isfinite(top) and top >= self.overflow:
                raise ProtocolError("local", f"value {top:.3g} overflows {self.spec.name}; use the bf16 or int8 codec")
        y = x.to(self.wire_dtype)
        # Compare with what the receiver rebuilds (y in x's dtype), in float32: reductions over float16
        # are slow on CPUs without native fp16 math.
        err = float(torch.dist(x.float(), y.to(x.dtype).float())) if x.numel() else 0.0
        frame = TensorFrame(codec=self.spec.name, dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=raw(y))
        raw_bytes = x.numel() * x.element_size()
        return frame, EncodeStats(self.spec.name, raw_bytes, frame.nbytes(), rel_error(x, err))


def decode_cast(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
    limits: TensorLimits, context: CodecContext | None,
) -> torch.Tensor:
    out_dtype = float_header(frame, spec, peer=peer, shape=shape, dtype=dtype, limits=limits)
    expect_sizes(frame, peer, 2 * frame.numel(), 0)
    return buffer(frame.data, _wire_dtype(spec.name)).to(out_dtype).reshape(frame.shape)


CAST = Codec(CastEncoder, decode_cast)
