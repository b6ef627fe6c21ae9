"""The swarm's boundary links in one process: what a codec does to training, without a network.

:class:`LinkSimulator` encodes and decodes every boundary tensor as the swarm's links would, so the
single-process reference trainer (``protolearn train-local``, ``scripts/bench_compression.py``) trains
with exactly the loss a codec causes, and counts the bytes that would cross each boundary.
"""

from __future__ import annotations

import torch

from protolearn.codec_spec import CodecSpec, parse_codec_spec
from protolearn.protocol.codecs.codec import CodecContext, Encoder
from protolearn.protocol.codecs.registry import decode, make_encoder
from protolearn.subspace import Subspace


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
