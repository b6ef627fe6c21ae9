"""What a collective message must be before a round looks at what it says: the round's first check.

:func:`refusal` runs on every message, before a byte of it is kept or a claim in it counts. It refuses
a sender that is not a participant (or is this replica), suspects that are not participants, a
contributor set that is not a subset of the round's contributors, an unknown phase or part index, a
scatter from a participant with weight 0, to a replica that does not reduce (or, cross-checked, check)
that part, or twice, and a part that is not float32 of the part's exact length or holds NaN or Inf.
Signatures and hashes come after it (:mod:`.part_ledger`, :mod:`.cross_check`, :mod:`.fins`), since
they cost more.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from protolearn.protocol.collective.ownership import checker, owner
from protolearn.protocol.collective.spec import RoundSpec


def refusal(
    spec: RoundSpec, out: Collection[str], slices: Mapping[int, Mapping[str, torch.Tensor]], peer: str, phase: str, part: int,
    data: torch.Tensor | None, contributors: Sequence[str], suspects: Sequence[str],
) -> str:
    """Why a message from ``peer`` must be refused ('' if not); ``out``: the peers held out here,
    ``slices``: the slices held here (part -> contributor -> slice)."""
    if peer not in spec.weights:
        return f"peer is not a participant of round {spec.round_id}"
    if peer == spec.me:
        return "a replica cannot send parts to itself"
    if not all(s in spec.weights for s in suspects):
        return "suspects name a peer that is not a participant"
    if phase == "probe":
        return ""
    members = set(contributors)
    if len(members) != len(contributors) or not members <= spec.contributors:
        return f"{phase} names a contributor set that is not a subset of the round's contributors"
    if phase == "fin":
        return ""
    if phase not in ("scatter", "gather"):
        return f"unknown phase {phase[:32]!r}"
    if not 0 <= part < len(spec.peers):
        return f"part {part} is out of range 0..{len(spec.peers) - 1}"
    if phase == "scatter":
        if spec.weights[peer] <= 0:
            return "a participant with weight 0 must not contribute"
        # The sender's claims count here (they only decide where a slice may be kept), never against me.
        claimed = set(out) | (set(suspects) - {spec.me})
        if owner(spec.peers, part, claimed, spec.me) != spec.me and not (
            spec.cross_check and checker(spec.peers, part, claimed, spec.me) == spec.me
        ):
            return f"scatter of part {part} sent to a replica that does not reduce it"
        if peer in slices.get(part, {}):
            return f"duplicate scatter of part {part}"
    a, b = spec.bounds[part]
    if data is None or data.dtype != torch.float32 or data.dim() != 1 or data.numel() != b - a:
        got = "nothing" if data is None else f"{data.dtype} {list(data.shape)}"
        return f"part {part} must be float32 of {b - a} elements, got {got}"
    # amax/amin propagate NaN and carry ±Inf, and cost a fraction of a full isfinite pass.
    if data.numel() and not bool(torch.isfinite(data.amax()) & torch.isfinite(data.amin())):
        return f"part {part} contains NaN or Inf"
    return ""
