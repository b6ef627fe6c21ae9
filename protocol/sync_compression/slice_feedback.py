"""One replica's side of a slice compression (``int8``, ``topk:F``): its contribution, with error feedback.

Per attempt at a step: :meth:`SliceCompressor.begin`, then, for a contributor, :meth:`~SliceCompressor.contribution`
(the compression of gradient plus residual, part by part over the round's parts; the difference is
staged as the next residual), then the round; :meth:`~SliceCompressor.commit` once the step is applied.
:mod:`.feedback` says why a failed, redone or lost step never counts its feedback twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protolearn.protocol.sync_compression.feedback import ErrorFeedback
from protolearn.protocol.sync_compression.slice_codec import SliceCodec


class SliceCompressor:
    """``codec``'s contributions of one replica, and its residual."""

    def __init__(self, codec: SliceCodec) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback()

    def begin(self, step: int) -> None:
        """An attempt at ``step`` starts: forget what an earlier attempt staged."""
        self.feedback.stage(step, None)

    def contribution(self, step: int, grad: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """What to contribute (numel,) for summed gradient ``grad`` (numel,) in a round with parts ``bounds``;
        stages the residual this leaves."""
        corrected = self.feedback.corrected(grad.to(torch.float32))
        sent = self.codec.contributions(corrected, bounds)
        self.feedback.stage(step, corrected - sent)
        return sent

    def commit(self, step: int) -> None:
        self.feedback.commit(step)

    def reset(self) -> None:
        self.feedback.reset()
