"""Part ownership in a collective round: who reduces which part, how, and in what order it goes out.

:class:`~protolearn.protocol.collective.CollectiveRound` is the round's state machine; this module holds
the pure rules it applies to parts, as plain functions of the participants and the suspects (no state
of the round, no IO), so that the round's correctness argument can point at each one.

How it works
------------
* :func:`part_bounds` cuts the vector into ``N`` contiguous parts (``N`` participants, sorted by peer id),
  the first ones larger.
* Part ``j`` has a **chain** of reducers ``peers[j], peers[j+1], ...`` (cyclic). :func:`owner` is the
  first one not suspected dead, so the next peer in sorted order is the backup, then the one after;
  :func:`successor` is the first live peer after a given one in that chain, and :func:`checker` the one
  after the owner, who recomputes the owner's part in a cross-checked round.
* :func:`reduce_part` adds ``w_p * x_p`` in sorted peer order with separate, correctly rounded multiply
  and add, so the value of a part over a contributor set ``S`` is a pure function of ``S``: any replica
  that reduces it gets the same bytes.
* :class:`Broadcast` orders an owner's sends of one reduced part **successor first**: to its successor,
  and to the other live peers only once the successor has acknowledged it (a new successor, after the
  old one died, gets it first again). So if any survivor holds a part from an owner that then died, the
  backup holds it too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

Op = Literal["sum", "weighted_mean"]


def part_bounds(numel: int, num_parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``num_parts`` contiguous ``[start, end)`` ranges, the first ones larger."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, got {num_parts}")
    base, extra = divmod(numel, num_parts)
    bounds = []
    start = 0
    for j in range(num_parts):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def owner(peers: Sequence[str], part: int, suspects: Collection[str], me: str) -> str:
    """The first peer of ``part``'s chain over sorted ``peers`` not in ``suspects``; ``me`` if all are."""
    n = len(peers)
    for i in range(n):
        p = peers[(part + i) % n]
        if p not in suspects:
            return p
    return me


def successor(peers: Sequence[str], part: int, me: str, suspects: Collection[str]) -> str | None:
    """The first peer after ``me`` in ``part``'s chain not in ``suspects``: the backup that gets parts first."""
    n = len(peers)
    k = (peers.index(me) - part) % n
    for i in range(k + 1, k + n):
        p = peers[(part + i) % n]
        if p != me and p not in suspects:
            return p
    return None


def checker(peers: Sequence[str], part: int, suspects: Collection[str], me: str) -> str | None:
    """The peer that cross-checks the owner of ``part``: its successor in the chain (None: nobody)."""
    return successor(peers, part, owner(peers, part, suspects, me), suspects)


def reduce_part(
    slices: Mapping[str, torch.Tensor], members: Collection[str], weights: Mapping[str, float], op: Op, length: int
) -> torch.Tensor:
    """The part over contributor set ``members`` from their ``slices`` (each float32 of ``length``)."""
    acc = torch.zeros(length, dtype=torch.float32)
    # Fixed order and separate multiply/add (never a fused alpha-add): the same bytes on any replica.
    for p in sorted(members):
        acc += slices[p] if op == "sum" else slices[p] * weights[p]
    if op == "weighted_mean":
        acc /= sum(weights[p] for p in sorted(members))
    return acc


@dataclass
class Broadcast:
    """An owner's sends of one reduced part: the successor first, then every other live peer."""

    first: str | None = None
    first_done: bool = False
    sent: set[str] = field(default_factory=set)

    def delivered(self, peer: str) -> None:
        """``peer`` acknowledged the part; if it is the successor, the others may have it now."""
        if peer == self.first:
            self.first_done = True

    def next_peers(self, succ: str | None, live_peers: Sequence[str]) -> list[str]:
        """The peers to send the part to now, given the current successor and live peers."""
        if not self.first_done:
            if succ is None:
                self.first_done = True
            elif succ != self.first:
                self.first = succ
                self.sent.add(succ)
                return [succ]
            else:
                return []
        out = [p for p in live_peers if p not in self.sent]
        self.sent.update(out)
        return out
