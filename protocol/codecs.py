"""Activation and gradient codecs: how a float tensor is squeezed into a :class:`TensorFrame`.

A codec spec names the codec and its parameter: ``none``, ``fp16``, ``bf16``, ``int8`` or
``topk[:fraction]``; its grammar and parser live in :mod:`protolearn.codec_spec`, shared with the run
config, and are re-exported here. :func:`make_encoder` builds a stateful encoder for one link (``topk`` keeps its
error-feedback residual there); :func:`decode` is stateless and trusts nothing.

Wire layouts (``frame.dtype``/``frame.shape`` are those of the decoded tensor; C order; little endian):

=========  =======================================  =============================================
codec      ``data``                                 ``aux``
=========  =======================================  =============================================
none       raw elements in ``frame.dtype``          empty
fp16       numel float16                            empty
bf16       numel bfloat16                           empty
int8       numel int8, row-major (R, C)             R float32 scales; row r is ``q[r] * scale[r]``
topk:F     k float32 values                         k int32 flat indices, strictly increasing
subspace:I the inner codec I's ``data`` for the        activations: (B, T) token ids, int16 (int32 when
           coefficients c, float32 (B, T, k)        the vocabulary exceeds 32768); then I's ``aux``
=========  =======================================  =============================================

For int8 a row is everything but the last dimension: C = ``shape[-1]`` and R = numel / C (a 0-dim
tensor is one row of one). For topk, k = ceil(F * numel), and the fraction is part of the codec name
on the wire (``topk:0.05``) so the receiver knows k exactly.

``subspace`` (Protocol Models; :mod:`protolearn.subspace`) needs a :class:`CodecContext` holding the
run's :class:`~protolearn.subspace.Subspace` and the direction. An activation h (B, T, D) of a
subspace-constrained model is E_fixed[tok] + U c, so it travels as c = Uᵀ (h - E_fixed[tok]) (B, T, k)
plus the token ids, and a gradient (which the receiving stage keeps in span(U)) as c = Uᵀ g alone. The
receiver rebuilds h = E_fixed[tok] + U c, or g = U c. The encoder refuses a tensor that is not in the
subspace (an unconstrained model), rather than sending a lossy projection of it.

:func:`decode` checks the codec name, dtype, shape, limits and exact byte counts before it allocates,
then index ranges and scales, and raises :class:`ProtocolError` naming the peer on any violation.
All math is vectorised torch: a per-element Python loop would hold the GIL and starve the network.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from protolearn.codec_spec import (
    CODECS,
    DEFAULT_TOPK_FRACTION,
    MAX_SPEC_CHARS,
    CodecSpec,
    CodecSpecError,
    parse_codec_spec,
)
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import (
    DEFAULT_LIMITS,
    DTYPE_NAMES,
    TensorFrame,
    TensorLimits,
    check_header,
    from_frame,
    to_frame,
)
from protolearn.subspace import Subspace

__all__ = [
    "CODECS", "DEFAULT_TOPK_FRACTION", "FLOAT_DTYPES", "MAX_INT8_SCALE", "MAX_SUBSPACE_DRIFT", "MAX_TOPK_RESIDUALS",
    "CodecContext", "CodecSpec", "CodecSpecError", "ENCODERS", "EncodeStats", "Encoder", "LinkSimulator", "TopKEncoder",
    "decode", "make_encoder", "parse_codec_spec", "token_ids",
]

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# int8 scales above this could overflow float32 once multiplied by |q| <= 128; a sender never needs them.
MAX_INT8_SCALE = torch.finfo(torch.float32).max / 128
# A topk encoder keeps one residual per tensor shape it has sent; a link rarely sees more than a few.
MAX_TOPK_RESIDUALS = 8
# topk on tensors this large first narrows the candidates with a threshold estimated from a sample.
_SAMPLED_TOPK_MIN = 1 << 16
_TOPK_SAMPLE = 1 << 14
# subspace: the largest part of a tensor (relative L2, measured on h - E_fixed[tok], or on g) that may lie
# outside span(U). A model projected after every step stays below 1e-5; a model that is not constrained
# has about sqrt(1 - k/D), close to 1. Between projections (subspace.period > 1) the drift is dropped.
MAX_SUBSPACE_DRIFT = 0.01
# subspace: token ids fit int16 up to this vocabulary size, int32 above it.
_INT16_VOCAB = 1 << 15


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


def make_encoder(spec: str | CodecSpec) -> Encoder:
    """Return a fresh encoder for one link. Raises :class:`CodecSpecError` for an unknown spec."""
    parsed = spec if isinstance(spec, CodecSpec) else parse_codec_spec(spec)
    return ENCODERS[parsed.name](parsed)


def _float_input(t: torch.Tensor, codec: str) -> torch.Tensor:
    if t.dtype not in FLOAT_DTYPES:
        raise ProtocolError("local", f"codec {codec} encodes float tensors only, got {t.dtype}")
    return t.detach()


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) if t.numel() else 0.0


def _rel_error(x: torch.Tensor, err: float) -> float:
    """||err|| / ||x||, with 0/0 = 0 (an all-zero tensor sent exactly)."""
    norm = _norm(x)
    if norm == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / norm


def _all_finite(t: torch.Tensor) -> bool:
    # amax/amin propagate NaN and expose +-Inf without the large bool temporary of isfinite().all().
    if not t.numel():
        return True
    return bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def _raw(t: torch.Tensor) -> bytes:
    """Little-endian C-order bytes of ``t`` (moved to CPU); works for bfloat16, which numpy lacks."""
    t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _rows(shape: Sequence[int]) -> tuple[int, int]:
    """(R, C) of the int8 row layout: C is the last dimension, a 0-dim tensor is one row of one."""
    if not shape:
        return 1, 1
    r = 1
    for d in shape[:-1]:
        r *= d
    return r, shape[-1]


def _topk_count(fraction: float, numel: int) -> int:
    return min(numel, math.ceil(fraction * numel))


class _NoneEncoder:
    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        frame = to_frame(t)
        return frame, EncodeStats("none", len(frame.data), frame.nbytes(), 0.0)


class _CastEncoder:
    """fp16 / bf16: a plain cast, refusing values that the narrow type would turn into Inf."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.wire_dtype = torch.float16 if spec.name == "fp16" else torch.bfloat16
        # The smallest magnitude that rounds to Inf: max + half a unit in the last place (a tie rounds
        # to the even neighbour, which is Inf).
        finfo = torch.finfo(self.wire_dtype)
        self.overflow = finfo.max + 2.0 ** math.floor(math.log2(finfo.max)) * finfo.eps / 2

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = _float_input(t, self.spec.name)
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
        frame = TensorFrame(codec=self.spec.name, dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=_raw(y))
        raw = x.numel() * x.element_size()
        return frame, EncodeStats(self.spec.name, raw, frame.nbytes(), _rel_error(x, err))


class _Int8Encoder:
    """Per-row absmax: scale = max|row| / 127, q = round(x / scale); every element is within scale / 2."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = _float_input(t, "int8")
        if not _all_finite(x):
            raise ProtocolError("local", "int8 cannot encode NaN or Inf (its row scale would be lost)")
        r, c = _rows(x.shape)
        rows = x.float().reshape(r, c)  # (R, C)
        if rows.numel():
            absmax = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))  # (R,), no |x| temporary
        else:
            absmax = torch.zeros(r, device=rows.device)
        scale = absmax / 127.0  # float32 absmax / 127 is always finite
        inv = torch.where(scale > 0, 1.0 / scale, 0.0).unsqueeze(1)  # (R, 1); an all-zero row stays 0
        z = rows * inv  # (R, C), in units of the row's step
        q = z.round().clamp_(-127, 127)  # (R, C)
        if x.dtype == torch.float32:
            # x - q * scale == scale * (z - q), so the error needs no rebuilt copy of x
            err = float(torch.linalg.vector_norm(torch.linalg.vector_norm(z.sub_(q), dim=1) * scale)) if rows.numel() else 0.0
        else:  # the receiver also rounds q * scale to x's dtype; measure exactly that
            err = float(torch.dist(rows, (q * scale.unsqueeze(1)).to(x.dtype).float())) if rows.numel() else 0.0
        q = q.to(torch.int8)
        frame = TensorFrame(codec="int8", dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=_raw(q), aux=_raw(scale))
        raw = x.numel() * x.element_size()
        return frame, EncodeStats("int8", raw, frame.nbytes(), _rel_error(rows, err))


class TopKEncoder:
    """Top-k sparsification with error feedback, one residual per tensor shape on this link.

    Each call adds the input to the residual, sends the k entries of largest magnitude and keeps the
    rest: residual += x; sent = topk(residual); residual -= sent. Over many steps the sum of what was
    sent plus the residual equals the sum of the inputs, so no gradient mass is ever dropped.
    """

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.fraction = spec.fraction if spec.fraction is not None else DEFAULT_TOPK_FRACTION
        self._residuals: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        # Fixed seed: the same inputs give the same frames, which keeps runs reproducible.
        self._rng = torch.Generator().manual_seed(0)

    def residual(self, shape: Sequence[int]) -> torch.Tensor | None:
        """The float32 residual kept for tensors of ``shape`` (None before the first send)."""
        flat = self._residuals.get(tuple(shape))
        return None if flat is None else flat.reshape(tuple(shape))

    def reset(self) -> None:
        """Forget all residuals (e.g. when the link's peer changes)."""
        self._residuals.clear()

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = _float_input(t, "topk")
        if not _all_finite(x):
            # A NaN would poison the residual forever; refuse it before it gets there.
            raise ProtocolError("local", "topk cannot encode NaN or Inf")
        key = tuple(x.shape)
        flat = x.float().reshape(-1)  # (N,)
        residual = self._residuals.pop(key, None)
        acc = flat.clone() if residual is None else residual.to(flat.device).add_(flat)
        k = _topk_count(self.fraction, flat.numel())
        idx = self._select(acc, k)  # (k,) int64, increasing
        vals = acc[idx]  # (k,) float32, as on the wire
        # residual -= sent, where sent is what the receiver rebuilds in x's dtype (exactly vals for float32)
        received = vals.to(x.dtype).float()
        if not _all_finite(received):  # only a float16 input whose residual grew past 65504
            raise ProtocolError("local", f"topk residual overflows {x.dtype}; send float32 or bfloat16 tensors")
        acc[idx] = vals - received
        self._residuals[key] = acc
        while len(self._residuals) > MAX_TOPK_RESIDUALS:
            self._residuals.popitem(last=False)
        # ||x - sent||: the unsent entries of x, and x - sent at the sent ones
        diff = flat.clone()
        diff[idx] -= received
        err = _norm(diff)
        frame = TensorFrame(
            codec=str(CodecSpec("topk", self.fraction)),
            dtype=DTYPE_NAMES[x.dtype],
            shape=list(x.shape),
            data=_raw(vals),
            aux=_raw(idx.to(torch.int32)),
        )
        raw = x.numel() * x.element_size()
        return frame, EncodeStats(frame.codec, raw, frame.nbytes(), _rel_error(flat, err))

    def _select(self, acc: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest |acc|, increasing.

        A full topk over millions of entries is slow on CPU, so a threshold is first estimated from a
        random sample, set low enough that the entries above it very likely number at least k; the
        exact top-k is then taken among those few. When the guess falls short, the full topk runs.
        The result is the exact top-k either way.
        """
        n = acc.numel()
        mag = acc.abs()
        if k == 0:
            return torch.zeros(0, dtype=torch.int64, device=acc.device)
        if n >= _SAMPLED_TOPK_MIN and k <= n // 4:
            sample = mag[torch.randint(n, (_TOPK_SAMPLE,), generator=self._rng).to(acc.device)]
            margin = min(_TOPK_SAMPLE, int(_TOPK_SAMPLE * k / n * 1.25) + 32)
            tau = torch.topk(sample, margin, sorted=False).values.min()
            (cand,) = torch.where(mag >= tau)  # increasing
            if cand.numel() >= k:
                return cand[_mask(torch.topk(mag[cand], k, sorted=False).indices, cand.numel())]
        (idx,) = torch.where(_mask(torch.topk(mag, k, sorted=False).indices, n))
        return idx


def _ids_dtype(sub: Subspace) -> torch.dtype:
    return torch.int16 if sub.vocab_size <= _INT16_VOCAB else torch.int32


def _ids_bytes(sub: Subspace, tokens: int) -> int:
    return tokens * _ids_dtype(sub).itemsize


class _SubspaceEncoder:
    """c = Uᵀ (h - E_fixed[tok]) for activations, c = Uᵀ g for gradients; c goes through the inner codec."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.inner = make_encoder(spec.inner or "fp16")  # none, fp16, bf16 or int8: all stateless

    def encode(self, t: torch.Tensor, *, context: CodecContext | None = None) -> tuple[TensorFrame, EncodeStats]:
        x = _float_input(t, "subspace")
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
            ids_raw = _raw(ids.to(_ids_dtype(sub)))
        c = r @ u  # (B, T, k)
        inside = c @ u.T  # (B, T, D): r's projection onto span(U)
        norm, off = _norm(r), _norm(r - inside)
        drift = off / norm if norm > 0 else 0.0
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
        err = math.hypot(off, inner_stats.rel_error * _norm(c))
        frame = TensorFrame(
            codec=str(self.spec), dtype=DTYPE_NAMES[x.dtype], shape=list(x.shape), data=inner.data, aux=ids_raw + inner.aux
        )
        raw = x.numel() * x.element_size()
        return frame, EncodeStats(frame.codec, raw, frame.nbytes(), _rel_error(x, err), tokens)


def _decode_subspace(frame: TensorFrame, spec: CodecSpec, peer: str, out_dtype: torch.dtype, limits: TensorLimits, context: CodecContext | None) -> torch.Tensor:
    if context is None or context.subspace is None:
        raise ProtocolError(
            peer, "sent a subspace frame, but this run has no subspace; set [subspace] rank in the run config, or pick another codec"
        )
    sub = context.subspace
    if len(frame.shape) != 3 or frame.shape[-1] != sub.d_model:
        raise ProtocolError(peer, f"subspace frame of shape {frame.shape} is not a (B, T, {sub.d_model}) boundary tensor")
    b, t, _ = frame.shape
    inner_spec = spec.inner or "fp16"
    # The inner codec's aux is empty except for int8's row scales; an activation's token ids come first.
    inner_aux = 4 * b * t if inner_spec == "int8" else 0
    n_ids = _ids_bytes(sub, b * t)
    sizes = {"fwd": inner_aux + n_ids, "bwd": inner_aux}
    wanted = [context.direction] if context.direction in sizes else ["fwd", "bwd"]  # none given: the layout tells
    direction = next((d for d in wanted if len(frame.aux) == sizes[d]), None)
    if direction is None:
        want = " or ".join(str(sizes[d]) for d in wanted)
        raise ProtocolError(peer, f"subspace frame of shape {frame.shape} needs {want} aux bytes, got {len(frame.aux)}")
    ids_raw, aux = (frame.aux[:n_ids], frame.aux[n_ids:]) if direction == "fwd" else (b"", frame.aux)
    inner = TensorFrame(codec=inner_spec, dtype="float32", shape=[b, t, sub.rank], data=frame.data, aux=aux)
    c = decode(inner, peer=peer, shape=[b, t, sub.rank], limits=limits, require_finite=False)  # checks every size
    h = c @ sub.basis.T  # (B, T, D)
    if ids_raw:
        ids = _buffer(ids_raw, _ids_dtype(sub)).long().reshape(b, t)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= sub.vocab_size):
            raise ProtocolError(peer, f"subspace token ids must lie in 0..{sub.vocab_size - 1}")
        h = h + sub.fixed_embedding[ids]
    return h.to(out_dtype)


def token_ids(frame: TensorFrame, *, peer: str, subspace: Subspace) -> torch.Tensor:
    """The (B, T) int64 token ids a ``subspace`` activation frame carries (already validated by :func:`decode`)."""
    if len(frame.shape) != 3 or len(frame.aux) < _ids_bytes(subspace, frame.shape[0] * frame.shape[1]):
        raise ProtocolError(peer, "frame carries no token ids")
    b, t = frame.shape[0], frame.shape[1]
    return _buffer(frame.aux[: _ids_bytes(subspace, b * t)], _ids_dtype(subspace)).long().reshape(b, t)


class LinkSimulator:
    """The swarm's boundary links in one process: encode, then decode, each boundary tensor.

    One encoder per (boundary, direction), as one replica per stage would have, so ``topk`` keeps its
    error feedback per link. Call it as the reference trainer's ``boundary`` hook; :attr:`wire_bytes`
    and :attr:`tokens` add up what crossed each direction.
    """

    def __init__(self, spec: str | CodecSpec, subspace: Subspace | None = None, period: int = 1) -> None:
        self.spec = spec if isinstance(spec, CodecSpec) else parse_codec_spec(spec)
        self.subspace = subspace
        self.period = period
        self._encoders: dict[tuple[int, str], Encoder] = {}
        self.wire_bytes = {"fwd": 0, "bwd": 0}
        self.tokens = {"fwd": 0, "bwd": 0}

    def __call__(self, boundary: int, direction: str, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        enc = self._encoders.get((boundary, direction))
        if enc is None:
            enc = self._encoders[(boundary, direction)] = make_encoder(self.spec)
        ctx = CodecContext.for_run(self.subspace, self.period, direction, tokens if direction == "fwd" else None)
        frame, stats = enc.encode(t, context=ctx)
        self.wire_bytes[direction] += stats.wire_bytes
        self.tokens[direction] += t.shape[0] * t.shape[1]
        return decode(frame, peer="local", shape=list(t.shape), dtype=t.dtype, context=ctx, require_finite=False).to(t.device)

    def bytes_per_token(self) -> float:
        """Wire bytes per token, both directions together (what one token costs a boundary)."""
        return sum(self.wire_bytes[d] / self.tokens[d] for d in ("fwd", "bwd") if self.tokens[d])


def _mask(indices: torch.Tensor, n: int) -> torch.Tensor:
    # Marking a boolean mask puts the indices in increasing order in O(n): sorting them is 50x slower on CPU.
    mask = torch.zeros(n, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return mask


# The codec registry: one encoder class per name of the grammar (a unit test holds the two equal).
ENCODERS: dict[str, Callable[[CodecSpec], Encoder]] = {
    "none": _NoneEncoder, "fp16": _CastEncoder, "bf16": _CastEncoder, "int8": _Int8Encoder, "topk": TopKEncoder,
    "subspace": _SubspaceEncoder,
}


def _buffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    # bytearray gives torch a writable buffer (a read-only one warns); the copy is one memcpy.
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _expect_sizes(frame: TensorFrame, peer: str, data: int, aux: int) -> None:
    if len(frame.data) != data or len(frame.aux) != aux:
        raise ProtocolError(
            peer,
            f"{frame.codec[:MAX_SPEC_CHARS]} frame of shape {frame.shape} needs {data}+{aux} bytes, "
            f"got {len(frame.data)}+{len(frame.aux)}",
        )


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
    if spec.name == "none":
        t = from_frame(frame, peer=peer, limits=limits, dtype=dtype, shape=shape)
        if require_finite and t.is_floating_point() and not _all_finite(t):
            raise ProtocolError(peer, "tensor contains NaN or Inf")
        return t
    out_dtype = check_header(frame, peer=peer, limits=limits, dtype=dtype, shape=shape)
    if out_dtype not in FLOAT_DTYPES:
        raise ProtocolError(peer, f"codec {spec.name} carries float tensors, not {frame.dtype}")
    n = frame.numel()
    if spec.name in ("fp16", "bf16"):
        wire = torch.float16 if spec.name == "fp16" else torch.bfloat16
        _expect_sizes(frame, peer, 2 * n, 0)
        t = _buffer(frame.data, wire).to(out_dtype).reshape(frame.shape)
    elif spec.name == "subspace":
        t = _decode_subspace(frame, spec, peer, out_dtype, limits, context)
    elif spec.name == "int8":
        r, c = _rows(frame.shape)
        _expect_sizes(frame, peer, n, 4 * r)
        scale = _buffer(frame.aux, torch.float32)  # (R,)
        if r and not bool(((scale >= 0) & (scale <= MAX_INT8_SCALE)).all()):  # NaN fails both comparisons
            raise ProtocolError(peer, f"int8 row scales must be finite, >= 0 and <= {MAX_INT8_SCALE:.3g}")
        q = _buffer(frame.data, torch.int8).reshape(r, c)  # (R, C)
        t = (q.float() * scale.unsqueeze(1)).to(out_dtype).reshape(frame.shape)
    else:  # topk
        k = _topk_count(spec.fraction if spec.fraction is not None else DEFAULT_TOPK_FRACTION, n)
        _expect_sizes(frame, peer, 4 * k, 4 * k)
        idx = _buffer(frame.aux, torch.int32).long()  # (k,)
        if k and (int(idx[0]) < 0 or int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all())):
            raise ProtocolError(peer, f"topk indices must be strictly increasing and within [0, {n})")
        vals = _buffer(frame.data, torch.float32)
        flat = torch.zeros(n, dtype=torch.float32)
        flat[idx] = vals
        t = flat.to(out_dtype).reshape(frame.shape)
    if require_finite and not _all_finite(t):
        raise ProtocolError(peer, f"{spec.name} tensor contains NaN or Inf")
    return t
