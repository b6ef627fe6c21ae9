"""What a codec is: an encoder per link, a decoder that trusts nothing, and what both of them share.

A :class:`Codec` pairs the two halves of one wire layout: ``encoder(spec)`` builds a fresh, possibly
stateful :class:`Encoder` for one link, and ``decode(frame, spec, ...)`` rebuilds the tensor from a
frame whose codec name it owns. Each codec module (``none.py``, ``cast.py``, ``int8.py``, ``topk.py``,
``subspace.py``) defines one and documents its layout; :mod:`.registry` maps the names of the codec
grammar (:mod:`protolearn.codec_spec`) to them.

A codec's ``decode`` validates its frame completely (the header against the receiver's expectations and
limits, exact byte counts, index ranges, scales) before it allocates, and raises
:class:`~protolearn.protocol.errors.ProtocolError` naming the peer; whether the result must be finite
is checked once, by :func:`~.registry.decode`. The helpers below are the byte and error arithmetic the
codecs share. All math is vectorised torch: a per-element Python loop would hold the GIL and starve the
network.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from protolearn.codec_spec import MAX_SPEC_CHARS, CodecSpec
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import TensorFrame, TensorLimits, check_header
from protolearn.subspace import Subspace

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# subspace: the largest part of a tensor (relative L2, measured on h - E_fixed[tok], or on g) that may lie
# outside span(U). A model projected after every step stays below 1e-5; a model that is not constrained
# has about sqrt(1 - k/D), close to 1. Between projections (subspace.period > 1) the drift is dropped.
MAX_SUBSPACE_DRIFT = 0.01


@dataclass(frozen=True)
class CodecContext:
    """Model state a codec may need; only ``subspace`` uses it.

    ``direction`` is ``fwd`` (activations, which carry ``token_ids`` (B, T) int64 when encoded) or
    ``bwd`` (activation gradients). ``subspace`` is the run's basis and fixed embedding.
    """

    subspace: Subspace | None = None
    direction: str | None = None  # "fwd" | "bwd"
    token_ids: torch.Tensor | None = None  # (B, T) int64, fwd encode only
    # The encoder refuses a tensor with more than this part outside span(U). A run that projects its
    # weights only every few steps (subspace.period > 1) drifts out between projections: pass math.inf.
    max_drift: float = MAX_SUBSPACE_DRIFT

    @staticmethod
    def for_run(subspace: Subspace | None, period: int, direction: str, token_ids: torch.Tensor | None = None) -> CodecContext:
        """The context of a run with this subspace and projection period (1 = exact at every step)."""
        return CodecContext(subspace, direction, token_ids, MAX_SUBSPACE_DRIFT if period == 1 else math.inf)


@dataclass(frozen=True)
class EncodeStats:
    """What one encode cost and lost: ``rel_error`` = ||x - decode(encode(x))|| / ||x||."""

    codec: str
    raw_bytes: int
    wire_bytes: int
    rel_error: float
    tokens: int = 0  # B * T for a boundary tensor (B, T, D); 0 when not known

    @property
    def ratio(self) -> float:
        """Wire bytes per raw byte (0.5 for fp16; smaller is better)."""
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def bytes_per_token(self) -> float:
        """Wire bytes per token of a boundary tensor (0.0 when the tensor is not one)."""
        return self.wire_bytes / self.tokens if self.tokens else 0.0


class Encoder(Protocol):
    """A per-link encoder. Stateful codecs (topk) keep their state here, so use one per link and direction."""

    spec: CodecSpec

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]: ...


class Decoder(Protocol):
    """Rebuild the tensor of a frame of this codec, after validating it; ``dtype``/``shape``: what the
    receiver expects (None accepts any within ``limits``)."""

    def __call__(
        self, frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
        limits: TensorLimits, context: CodecContext | None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Codec:
    """One codec of the grammar: its encoder factory and its decoder, which share one wire layout."""

    encoder: Callable[[CodecSpec], Encoder]
    decode: Decoder


# -- what the codecs share -------------------------------------------------------------------------


def float_input(t: torch.Tensor, codec: str) -> torch.Tensor:
    if t.dtype not in FLOAT_DTYPES:
        raise ProtocolError("local", f"codec {codec} encodes float tensors only, got {t.dtype}")
    return t.detach()


def float_header(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None, limits: TensorLimits
) -> torch.dtype:
    """Check a lossy codec's frame header (dtype, shape, limits) and return the float dtype it decodes to."""
    out_dtype = check_header(frame, peer=peer, limits=limits, dtype=dtype, shape=shape)
    if out_dtype not in FLOAT_DTYPES:
        raise ProtocolError(peer, f"codec {spec.name} carries float tensors, not {frame.dtype}")
    return out_dtype


def norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) if t.numel() else 0.0


def rel_error(x: torch.Tensor, err: float) -> float:
    """||err|| / ||x||, with 0/0 = 0 (an all-zero tensor sent exactly)."""
    n = norm(x)
    if n == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / n


def all_finite(t: torch.Tensor) -> bool:
    # amax/amin propagate NaN and expose +-Inf without the large bool temporary of isfinite().all().
    if not t.numel():
        return True
    return bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def raw(t: torch.Tensor) -> bytes:
    """Little-endian C-order bytes of ``t`` (moved to CPU); works for bfloat16, which numpy lacks."""
    t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def buffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    # bytearray gives torch a writable buffer (a read-only one warns); the copy is one memcpy.
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def expect_sizes(frame: TensorFrame, peer: str, data: int, aux: int) -> None:
    if len(frame.data) != data or len(frame.aux) != aux:
        raise ProtocolError(
            peer,
            f"{frame.codec[:MAX_SPEC_CHARS]} frame of shape {frame.shape} needs {data}+{aux} bytes, "
            f"got {len(frame.data)}+{len(frame.aux)}",
        )
