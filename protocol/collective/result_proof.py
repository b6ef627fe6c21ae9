"""Proof that a round's full result is the one its participants committed: a strict majority of their signed fins.

A replica that did not finish a round itself takes its result from a participant that did: a replica the
step's accounting left out (it processed no ticket), or a participant whose own round failed while the others
finished (a liar's fin left it out, say). That result is one peer's word (DESIGN.md, Trust, rule 1): before,
a left-out replica took whatever the first participant it asked sent, and so voted for a liar's made-up
result in its stage's commit. Now the serving participant sends, with the vector, the fins it holds (each
participant's signed "I committed contributor set ``C`` with result hash ``H``",
:func:`~protolearn.protocol.statements.fin_statement`), and the taker accepts the vector only when

- every contributor is in ``C`` (only full averages are served, so its own contribution is in too), and
- fins naming that ``C`` and the vector's own result hash are signed by a **strict majority of the round's
  participants**, each against the round digest the taker computes itself from the round's id, its
  participants and weights (the coordinator's accounting), the vector's length and the operation.

So a liar among the participants can serve nothing but the honest result while honest participants are a
strict majority of the round (it cannot sign for them), and the taker's vote in the commit counts only for a
result that majority committed. A round of two participants needs both fins, a round of one its only one:
then the result rests on its single participant, as its computation does anyway (the integrity layer's to
check).

Under a compressed replica sync (``[sync] compression``, :mod:`protolearn.node.replica_sync`) every round a
step runs is proven alike: an ``int8`` / ``topk:F`` round's digest binds its slice compression, so a fin
of that round proves exactly its decoded float32 result; PowerSGD's two rounds (its P and Q factors, of
their own lengths) are ordinary rounds, each proven by its own fins, and the update is a pure function of
the two proven vectors. Pure: it hashes and verifies, and loads torch only to hash the vector's parts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from protolearn.protocol.collective.ownership import part_bounds
from protolearn.protocol.majority import majority_size
from protolearn.protocol.statements import HASH_BYTES, SIGNATURE_BYTES, Verify, fin_statement, members_mask, op_tag, part_hash, result_hash, round_digest


@dataclass(frozen=True)
class HeldFin:
    """A participant's signed fin as a serving replica keeps it: its contributor set as a mask over the round's
    sorted participants."""

    signer: str
    mask: bytes
    digest: bytes
    signature: bytes


def vector_digest(result: torch.Tensor, num_participants: int) -> bytes:
    """The collective's result hash of ``result`` (``(numel,)``) cut into ``num_participants`` parts: what each
    participant's fin names."""
    return result_hash([part_hash(result[a:b]) for a, b in part_bounds(result.numel(), num_participants)])


def fins_of(peers: Sequence[str], held: Mapping[str, tuple[Collection[str], bytes, bytes]]) -> list[HeldFin]:
    """The fins a finished participant holds (``held``: signer → (members, result hash, signature)), as served."""
    return [HeldFin(p, members_mask(peers, m), d, s) for p, (m, d, s) in sorted(held.items())]


def unproven(
    result: torch.Tensor, fins: Sequence[HeldFin], *, round_id: int, weights: Mapping[str, float], op: str, rule_tag: str,
    cross_check: bool, verify: Verify, compression: str = "none",
) -> str:
    """Why ``result`` is not proven to be round ``round_id``'s full result ('' if it is); see the module docstring.
    ``weights``: the round's participants and weights; ``op``, ``rule_tag``, ``cross_check``, ``compression`` (the
    round's slice compression tag, :mod:`protolearn.protocol.sync_compression.slice_codec`): what the round's
    digest binds, with the vector's own length."""
    peers = sorted(weights)
    if not peers:
        return "the round has no participants"
    contributors = [p for p in peers if weights[p] > 0]
    full = members_mask(peers, contributors)
    digest = vector_digest(result, len(peers))
    dig = round_digest(round_id, weights, result.numel(), op_tag(op, rule_tag, cross_check, compression))
    statement = fin_statement(dig, full, digest)
    signers: set[str] = set()
    for f in fins:
        if f.signer not in weights or f.signer in signers or f.mask != full or f.digest != digest:
            continue
        if len(f.signature) == SIGNATURE_BYTES and len(f.digest) == HASH_BYTES and verify(f.signer, statement, f.signature):
            signers.add(f.signer)
    need = majority_size(len(peers))
    if len(signers) < need:
        return (f"only {len(signers)} of the round's {len(peers)} participants signed a fin for this full result; "
                f"{need} needed")
    return ""
