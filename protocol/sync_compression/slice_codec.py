"""A compression that acts on the collective's slices: what a round's parts are projected onto.

``int8`` and ``topk:F`` compress part by part (the parts of :func:`~protolearn.protocol.collective.ownership.part_bounds`),
so they fit inside one collective round. A :class:`SliceCodec` names three deterministic maps of a part
(``(L,)`` float32 to ``(L,)`` float32), the same bits on every machine:

* :meth:`~SliceCodec.contribution`: what a contributor sends of its slice (before the round; the
  contributor keeps the difference as error feedback, :mod:`.feedback`);
* :meth:`~SliceCodec.reduced`: what an owner sends of the part it reduced, and what every replica,
  the owner too, then holds (``int8``: int8 blocks again; ``topk``: the sum as it is);
* :meth:`~SliceCodec.encode`: the blob (:mod:`.wire`) that carries a part losslessly: compact for a
  part that one of the two maps produced, and still exact (sparse or dense float32) for any other, such
  as a part signed by a liar that an honest backup relays.

Each map is idempotent, so a contribution projected twice, or a reduced part projected by a checker that
recomputes it, is the same bits. :attr:`~SliceCodec.tag` is bound into every statement of the round
(:func:`~protolearn.protocol.statements.op_tag`), so a part signed in a compressed round never counts in
another one. PowerSGD is not a slice codec: it needs two rounds (:mod:`.powersgd`); ``none`` is no codec
(None), and the collective then runs exactly as it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protolearn.protocol.sync_compression import blockfloat, sparse, wire
from protolearn.sync_spec import SyncCompression


@dataclass(frozen=True)
class SliceCodec:
    """The part maps of one slice compression (see the module docstring); ``spec`` names it."""

    spec: SyncCompression

    def __post_init__(self) -> None:
        if self.spec.name not in ("int8", "topk"):
            raise ValueError(f"{self.spec} does not compress slice by slice")

    @property
    def tag(self) -> str:
        return str(self.spec)

    def contribution(self, part: torch.Tensor) -> torch.Tensor:
        if self.spec.name == "int8":
            return blockfloat.project(part)
        assert self.spec.fraction is not None
        return sparse.project(part, self.spec.fraction)

    def reduced(self, part: torch.Tensor) -> torch.Tensor:
        return blockfloat.project(part) if self.spec.name == "int8" else part

    def encode(self, part: torch.Tensor) -> bytes:
        if self.spec.name == "int8":
            e, q = blockfloat.quantize(part)
            if torch.equal(blockfloat.dequantize(e, q), part):
                return wire.encode_int8_blocks(part.numel(), e, q)
        # topk, or a part that is not int8 blocks: an honest replica relays whatever part its signer signed
        # (a liar's, say), and must relay it unchanged.
        return wire.encode_sparse(part)

    def contributions(self, vector: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """:meth:`contribution` of every part of ``vector`` (numel,), as one (numel,) vector."""
        if not bounds:
            return vector.clone()
        return torch.cat([self.contribution(vector[a:b]) for a, b in bounds])


def slice_codec(spec: SyncCompression) -> SliceCodec | None:
    """The slice codec of ``spec``; None where the collective carries raw float32 (``none``, and ``powersgd``,
    whose rounds are exact)."""
    return SliceCodec(spec) if spec.name in ("int8", "topk") else None
