"""The ``none`` codec: the tensor as it is.

Layout: ``data`` holds the raw elements in ``frame.dtype`` (C order, little endian), ``aux`` is empty.
Any dtype of the tensor frames goes (:mod:`protolearn.protocol.tensors`), not only floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protolearn.codec_spec import CodecSpec
from protolearn.protocol.codecs.codec import Codec, CodecContext, EncodeStats
from protolearn.protocol.tensors import TensorFrame, TensorLimits, from_frame, to_frame


class NoneEncoder:
    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        frame = to_frame(t)
        return frame, EncodeStats("none", len(frame.data), frame.nbytes(), 0.0)


def decode_none(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
    limits: TensorLimits, context: CodecContext | None,
) -> torch.Tensor:
    return from_frame(frame, peer=peer, limits=limits, dtype=dtype, shape=shape)


NONE = Codec(NoneEncoder, decode_none)
