"""The codec registry: each name of the codec grammar mapped to its :class:`~.codec.Codec`, and the two
entry points that go through it, :func:`make_encoder` and :func:`decode`.

The names are the grammar's (:data:`protolearn.codec_spec.CODECS`, its one owner); a unit test holds
the registry's keys equal to them, so a spec the run config accepts is one the codecs can run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protolearn.codec_spec import CodecSpec, CodecSpecError, parse_codec_spec
from protolearn.protocol.codecs.cast import CAST
from protolearn.protocol.codecs.codec import Codec, CodecContext, Encoder, all_finite
from protolearn.protocol.codecs.int8 import INT8
from protolearn.protocol.codecs.none import NONE
from protolearn.protocol.codecs.subspace import SUBSPACE
from protolearn.protocol.codecs.topk import TOPK
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import DEFAULT_LIMITS, TensorFrame, TensorLimits

REGISTRY: dict[str, Codec] = {"none": NONE, "fp16": CAST, "bf16": CAST, "int8": INT8, "topk": TOPK, "subspace": SUBSPACE}


def make_encoder(spec: str | CodecSpec) -> Encoder:
    """Return a fresh encoder for one link. Raises :class:`CodecSpecError` for an unknown spec."""
    parsed = spec if isinstance(spec, CodecSpec) else parse_codec_spec(spec)
    return REGISTRY[parsed.name].encoder(parsed)


def decode(
    frame: TensorFrame,
    *,
    peer: str,
    shape: Sequence[int] | None,
    dtype: torch.dtype | None = torch.float32,
    limits: TensorLimits = DEFAULT_LIMITS,
    context: CodecContext | None = None,
    require_finite: bool = True,
) -> torch.Tensor:
    """Rebuild the tensor a peer encoded, after validating the frame completely.

    ``shape`` and ``dtype`` are what the receiver expects (None accepts any within ``limits``); the
    result has ``frame.dtype``, which then equals ``dtype``. ``subspace`` frames need ``context``
    (the run's subspace and the direction). Raises :class:`ProtocolError` (or
    :class:`~protolearn.protocol.errors.TooLarge`) naming ``peer``.
    """
    try:
        spec = parse_codec_spec(frame.codec, field="frame codec")
    except CodecSpecError as err:
        raise ProtocolError(peer, str(err)) from None
    t = REGISTRY[spec.name].decode(frame, spec, peer=peer, shape=shape, dtype=dtype, limits=limits, context=context)
    if require_finite and t.is_floating_point() and not all_finite(t):
        what = "tensor" if spec.name == "none" else f"{spec.name} tensor"
        raise ProtocolError(peer, f"{what} contains NaN or Inf")
    return t
