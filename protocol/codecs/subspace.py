"""The ``subspace[:I]`` codec: a boundary tensor as its coefficients in the run's fixed basis.

Protocol Models (:mod:`protolearn.subspace`). An activation h (B, T, D) of a subspace-constrained model
is E_fixed[tok] + U c, so it travels as c = Uᵀ (h - E_fixed[tok]) (B, T, k) plus the token ids, and a
gradient (which the receiving stage keeps in span(U)) as c = Uᵀ g alone. The receiver rebuilds
h = E_fixed[tok] + U c, or g = U c. The encoder refuses a tensor that is not in the subspace (an
unconstrained model), rather than sending a lossy projection of it. Both sides need a
:class:`~.codec.CodecContext` holding the run's :class:`~protolearn.subspace.Subspace` and the direction.

Layout: ``data`` is the inner codec I's ``data`` for the coefficients c, float32 (B, T, k) (I is one of
the grammar's ``SUBSPACE_INNER``: none, fp16, bf16 or int8); ``aux`` holds, for an activation, the
(B, T) token ids as int16 (int32 when the vocabulary exceeds 32768), then I's ``aux``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protolearn.codec_spec import DEFAULT_SUBSPACE_INNER, CodecSpec, parse_codec_spec
from protolearn.protocol.codecs.cast import CAST
from protolearn.protocol.codecs.codec import (
    Codec,
    CodecContext,
    EncodeStats,
    buffer,
    float_header,
    float_input,
    norm,
    raw,
    rel_error,
)
from protolearn.protocol.codecs.int8 import INT8
from protolearn.protocol.codecs.none import NONE
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import DTYPE_NAMES, TensorFrame, TensorLimits
from protolearn.subspace import Subspace

# subspace: token ids fit int16 up to this vocabulary size, int32 above it.
_INT16_VOCAB = 1 << 15
# The codecs of the coefficients, by the grammar's SUBSPACE_INNER names (all stateless).
_INNER: dict[str, Codec] = {"none": NONE, "fp16": CAST, "bf16": CAST, "int8": INT8}


def _ids_dtype(sub: Subspace) -> torch.dtype:
    return torch.int16 if sub.vocab_size <= _INT16_VOCAB else torch.int32


def _ids_bytes(sub: Subspace, tokens: int) -> int:
    return tokens * _ids_dtype(sub).itemsize


def _inner_spec(spec: CodecSpec) -> CodecSpec:
    return parse_codec_spec(spec.inner or DEFAULT_SUBSPACE_INNER)


class SubspaceEncoder:
    """c = Uᵀ (h - E_fixed[tok]) for activations, c = Uᵀ g for gradients; c goes through the inner codec."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        inner = _inner_spec(spec)
        self.inner = _INNER[inner.name].encoder(inner)

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = float_input(t, "subspace")
        if context is None or context.subspace is None:
            raise ProtocolError(
                "local", "codec subspace needs a subspace-constrained model; set [subspace] rank in the run config, or pick another codec"
            )
        sub, direction = context.subspace, context.direction
        if direction not in ("fwd", "bwd"):
            raise ProtocolError("local", f"codec subspace needs the direction fwd or bwd, got {direction!r}")
        u = sub.basis.to(x.device)  # (D, k)
        if x.dim() != 3 or x.shape[-1] != sub.d_model:
            raise ProtocolError("local", f"codec subspace encodes (B, T, {sub.d_model}) boundary tensors, got {tuple(x.shape)}")
        tokens = x.shape[0] * x.shape[1]
        ids_raw = b""
        r = x.float()  # (B, T, D)
        fixed = None
        if direction == "fwd":
            ids = context.token_ids
            if ids is None or tuple(ids.shape) != tuple(x.shape[:2]) or ids.dtype != torch.int64:
                raise ProtocolError("local", f"codec subspace needs the int64 token ids {tuple(x.shape[:2])} of an activation")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= sub.vocab_size):
                raise ProtocolError("local", f"token ids outside 0..{sub.vocab_size - 1}")
            fixed = sub.fixed_embedding.to(x.device)[ids]  # (B, T, D)
            r = r - fixed
            ids_raw = raw(ids.to(_ids_dtype(sub)))
        c = r @ u  # (B, T, k)
        inside = c @ u.T  # (B, T, D): r's projection onto span(U)
        total, off = norm(r), norm(r - inside)
        drift = off / total if total > 0 else 0.0
        if drift > context.max_drift:  # NaN compares False and passes through, as with the none codec
            what = "activations" if direction == "fwd" else "gradients"
            raise ProtocolError(
                "local",
                f"{what} lie {drift:.0%} outside the run's subspace: this stage's model is not subspace-constrained "
                "(a checkpoint from a run without [subspace]?); the subspace codec refuses to drop that part",
            )
        inner, inner_stats = self.inner.encode(c.contiguous())
        # x - rebuilt = (r - U c) + U (c - c_received): the drift and the inner codec's error, orthogonal to
        # each other (U has orthonormal columns), so the true error needs no decode here.
        err = math.hypot(off, inner_stats.rel_error * norm(c))
        frame = TensorFrame(
            codec=str(self.spec), dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=inner.data, aux=ids_raw + inner.aux
        )
        raw_bytes = x.numel() * x.element_size()
        return frame, EncodeStats(frame.codec, raw_bytes, frame.nbytes(), rel_error(x, err), tokens)


def decode_subspace(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
    limits: TensorLimits, context: CodecContext | None,
) -> torch.Tensor:
    out_dtype = float_header(frame, spec, peer=peer, shape=shape, dtype=dtype, limits=limits)
    if context is None or context.subspace is None:
        raise ProtocolError(
            peer, "sent a subspace frame, but this run has no subspace; set [subspace] rank in the run config, or pick another codec"
        )
    sub = context.subspace
    if len(frame.shape) != 3 or frame.shape[-1] != sub.d_model:
        raise ProtocolError(peer, f"subspace frame of shape {frame.shape} is not a (B, T, {sub.d_model}) boundary tensor")
    b, t, _ = frame.shape
    inner_spec = _inner_spec(spec)
    # The inner codec's aux is empty except for int8's row scales; an activation's token ids come first.
    inner_aux = 4 * b * t if inner_spec.name == "int8" else 0
    n_ids = _ids_bytes(sub, b * t)
    sizes = {"fwd": inner_aux + n_ids, "bwd": inner_aux}
    wanted = [context.direction] if context.direction in sizes else ["fwd", "bwd"]  # none given: the layout tells
    direction = next((d for d in wanted if len(frame.aux) == sizes[d]), None)
    if direction is None:
        want = " or ".join(str(sizes[d]) for d in wanted)
        raise ProtocolError(peer, f"subspace frame of shape {frame.shape} needs {want} aux bytes, got {len(frame.aux)}")
    ids_raw, aux = (frame.aux[:n_ids], frame.aux[n_ids:]) if direction == "fwd" else (b"", frame.aux)
    inner = TensorFrame(codec=str(inner_spec), dtype="float32", shape=[b, t, sub.rank], data=frame.data, aux=aux)
    # The inner decoder checks every size; the coefficients need not be finite (the result is checked).
    c = _INNER[inner_spec.name].decode(
        inner, inner_spec, peer=peer, shape=[b, t, sub.rank], dtype=torch.float32, limits=limits, context=None
    )
    h = c @ sub.basis.T  # (B, T, D)
    if ids_raw:
        ids = buffer(ids_raw, _ids_dtype(sub)).long().reshape(b, t)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= sub.vocab_size):
            raise ProtocolError(peer, f"subspace token ids must lie in 0..{sub.vocab_size - 1}")
        h = h + sub.fixed_embedding[ids]
    return h.to(out_dtype)


def token_ids(frame: TensorFrame, *, peer: str, subspace: Subspace) -> torch.Tensor:
    """The (B, T) int64 token ids a ``subspace`` activation frame carries (already validated by :func:`~protolearn.protocol.codecs.decode`)."""
    if len(frame.shape) != 3 or len(frame.aux) < _ids_bytes(subspace, frame.shape[0] * frame.shape[1]):
        raise ProtocolError(peer, "frame carries no token ids")
    b, t = frame.shape[0], frame.shape[1]
    return buffer(frame.aux[: _ids_bytes(subspace, b * t)], _ids_dtype(subspace)).long().reshape(b, t)


SUBSPACE = Codec(SubspaceEncoder, decode_subspace)
