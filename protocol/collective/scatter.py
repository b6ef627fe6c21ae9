"""A contributor's side of a collective round: its slice of every part goes to whoever reduces it.

Every contributor (weight > 0) sends its slice of part ``j`` to the owner of ``j`` and, in a cross-checked
round, to the part's checker (:mod:`.cross_check`) too, with its signature of the slice's hash. When it
comes to hold an owner or checker out, it sends the slice again to the new one: it still holds its whole
vector, so the round never waits on a dead owner for a live contributor's slice. A slice for itself (it
owns or checks that part) it keeps at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from protolearn.protocol.collective.actions import Send
from protolearn.protocol.collective.cross_check import CrossCheck
from protolearn.protocol.collective.ownership import checker, owner
from protolearn.protocol.collective.spec import RoundSpec


@dataclass
class Scatter:
    """Where this replica's slices must be and where they went. ``slices``: the round's held slices (part ->
    contributor -> slice), where a slice for itself goes; ``suspects``: the round's peers held out."""

    spec: RoundSpec
    cross: CrossCheck
    slices: dict[int, dict[str, torch.Tensor]]
    suspects: Collection[str]
    vector: torch.Tensor | None = None  # (numel,) float32 once the round starts
    sent_to: dict[int, set[str]] = field(default_factory=dict)  # part -> reducers (owner, checker) that have my slice

    def targets(self, part: int) -> list[str]:
        """The reducers of ``part`` that must hold my slice now: its owner and, cross-checked, its checker."""
        spec = self.spec
        o = owner(spec.peers, part, self.suspects, spec.me)
        c = checker(spec.peers, part, self.suspects, spec.me) if spec.cross_check else None
        return [o] if c is None or c == o else [o, c]

    def due(self) -> list[Send]:
        """The slices that must go out now (keeping mine for the parts I reduce or check)."""
        spec, sends = self.spec, []
        for j in range(len(spec.peers)):
            have = self.sent_to.setdefault(j, set())
            for o in self.targets(j):
                if o in have:
                    continue
                have.add(o)
                data, digest, signature = self._slice(j)
                if o == spec.me:
                    self.slices.setdefault(j, {})[spec.me] = data
                else:
                    sends.append(Send(o, "scatter", j, data, (), spec.me if digest else "", digest, signature))
        return sends

    def _slice(self, part: int) -> tuple[torch.Tensor, bytes, bytes]:
        assert self.vector is not None
        a, b = self.spec.bounds[part]
        data = self.vector[a:b]
        if not self.spec.cross_check:
            return data, b"", b""
        return data, *self.cross.my_proof(part, data)
