"""What every participant of one collective round agrees on before it starts, and what follows from it.

A :class:`RoundSpec` is fixed for the round's life: its id, the participants with their weights, the
vector's length, the operation, the aggregation rule, whether parts are cross-checked and the slice
compression (:mod:`protolearn.protocol.sync_compression.slice_codec`; None: raw float32), which the
round digest binds every signed statement to (:func:`~protolearn.protocol.statements.round_digest`),
plus this replica's identity and keys. From it follow the sorted peers, the parts' bounds
(:func:`~.ownership.part_bounds`), the contributors (weight > 0) and the reduction of a part over a set
(:func:`~.robust.robust_reduce`, a pure function of the set and its slices, then the compression's
projection of a reduced part, also pure). The parts of a round
(:mod:`.fins`, :mod:`.cross_check`, :mod:`.scatter`, :mod:`.waits`, :mod:`.admission`) read it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from protolearn.protocol.bounds import MAX_PARTICIPANTS
from protolearn.protocol.collective.ownership import Op, part_bounds
from protolearn.protocol.collective.robust import Aggregation, robust_reduce
from protolearn.protocol.statements import Sign, Verify, members_mask, op_tag, round_digest
from protolearn.protocol.sync_compression.slice_codec import SliceCodec


@dataclass(frozen=True)
class RoundSpec:
    """Round ``round_id`` among ``weights``' peers as replica ``me`` sees it; see :class:`~.round.CollectiveRound`."""

    round_id: int
    me: str
    weights: Mapping[str, float]
    numel: int
    op: Op
    aggregation: Aggregation
    cross_check: bool
    sign: Sign = field(repr=False)
    verify: Verify = field(repr=False)
    codec: SliceCodec | None = None
    peers: list[str] = field(init=False)
    bounds: list[tuple[int, int]] = field(init=False)
    contributors: frozenset[str] = field(init=False)
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        if self.me not in self.weights:
            raise ValueError(f"this replica {self.me} is not a participant of round {self.round_id}")
        if len(self.weights) > MAX_PARTICIPANTS:
            raise ValueError(f"{len(self.weights)} participants exceed the limit of {MAX_PARTICIPANTS}")
        if any(not w >= 0 for w in self.weights.values()):
            raise ValueError(f"weights must be non-negative, got {self.weights}")
        if self.op == "weighted_mean" and sum(self.weights.values()) <= 0:
            raise ValueError("a weighted mean needs at least one participant with a positive weight")
        peers = sorted(self.weights)
        tag = op_tag(self.op, self.aggregation.tag, self.cross_check, "none" if self.codec is None else self.codec.tag)
        object.__setattr__(self, "peers", peers)
        object.__setattr__(self, "bounds", part_bounds(self.numel, len(peers)))
        object.__setattr__(self, "contributors", frozenset(p for p in peers if self.weights[p] > 0))
        object.__setattr__(self, "digest", round_digest(self.round_id, self.weights, self.numel, tag))

    def mask(self, members: Collection[str]) -> bytes:
        """``members`` as the bitmask over the sorted peers that statements carry."""
        return members_mask(self.peers, members)

    def reduce(self, held: Mapping[str, torch.Tensor], members: frozenset[str], part: int) -> torch.Tensor:
        """Part ``part`` over ``members`` from their ``held`` slices: the same bytes on every replica."""
        a, b = self.bounds[part]
        reduced = robust_reduce(held, members, self.weights, self.op, b - a, self.aggregation)
        return reduced if self.codec is None else self.codec.reduced(reduced)
