"""The ``topk[:F]`` codec: top-k sparsification with error feedback.

Layout: ``data`` holds k float32 values and ``aux`` their k int32 flat indices, strictly increasing,
where k = ceil(F * numel). The fraction is part of the codec name on the wire (``topk:0.05``), so the
receiver knows k exactly; it refuses indices out of range or out of order.

The encoder is stateful (:class:`TopKEncoder`): what it did not send it keeps, per tensor shape, and
adds to the next tensor of that shape, so over many steps no gradient mass is dropped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from protolearn.codec_spec import DEFAULT_TOPK_FRACTION, CodecSpec
from protolearn.protocol.codecs.codec import (
    Codec,
    CodecContext,
    EncodeStats,
    all_finite,
    buffer,
    expect_sizes,
    float_header,
    float_input,
    norm,
    raw,
    rel_error,
)
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.tensors import DTYPE_NAMES, TensorFrame, TensorLimits

# A topk encoder keeps one residual per tensor shape it has sent; a link rarely sees more than a few.
MAX_TOPK_RESIDUALS = 8
# topk on tensors this large first narrows the candidates with a threshold estimated from a sample.
_SAMPLED_TOPK_MIN = 1 << 16
_TOPK_SAMPLE = 1 << 14


def _topk_count(fraction: float, numel: int) -> int:
    return min(numel, math.ceil(fraction * numel))


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
        x = float_input(t, "topk")
        if not all_finite(x):
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
        if not all_finite(received):  # only a float16 input whose residual grew past 65504
            raise ProtocolError("local", f"topk residual overflows {x.dtype}; send float32 or bfloat16 tensors")
        acc[idx] = vals - received
        self._residuals[key] = acc
        while len(self._residuals) > MAX_TOPK_RESIDUALS:
            self._residuals.popitem(last=False)
        # ||x - sent||: the unsent entries of x, and x - sent at the sent ones
        diff = flat.clone()
        diff[idx] -= received
        err = norm(diff)
        frame = TensorFrame(
            codec=str(CodecSpec("topk", self.fraction)),
            dtype=DTYPE_NAMES[x.dtype],
            shape=list(x.shape),
            data=raw(vals),
            aux=raw(idx.to(torch.int32)),
        )
        raw_bytes = x.numel() * x.element_size()
        return frame, EncodeStats(frame.codec, raw_bytes, frame.nbytes(), rel_error(flat, err))

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


def _mask(indices: torch.Tensor, n: int) -> torch.Tensor:
    # Marking a boolean mask puts the indices in increasing order in O(n): sorting them is 50x slower on CPU.
    mask = torch.zeros(n, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return mask


def decode_topk(
    frame: TensorFrame, spec: CodecSpec, *, peer: str, shape: Sequence[int] | None, dtype: torch.dtype | None,
    limits: TensorLimits, context: CodecContext | None,
) -> torch.Tensor:
    out_dtype = float_header(frame, spec, peer=peer, shape=shape, dtype=dtype, limits=limits)
    n = frame.numel()
    k = _topk_count(spec.fraction if spec.fraction is not None else DEFAULT_TOPK_FRACTION, n)
    expect_sizes(frame, peer, 4 * k, 4 * k)
    idx = buffer(frame.aux, torch.int32).long()  # (k,)
    if k and (int(idx[0]) < 0 or int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all())):
        raise ProtocolError(peer, f"topk indices must be strictly increasing and within [0, {n})")
    vals = buffer(frame.data, torch.float32)
    flat = torch.zeros(n, dtype=torch.float32)
    flat[idx] = vals
    return flat.to(out_dtype).reshape(frame.shape)


TOPK = Codec(TopKEncoder, decode_topk)
