"""The reducer cross-check of a collective round (``cross_check=True``): a part's checker recomputes it.

* Every contributor signs its slice of each part (:func:`~protolearn.protocol.statements.slice_statement`)
  and sends it to the part's owner **and** to the owner's successor in the chain, the part's **checker**
  (re-sending to both whenever either changes). Receivers keep a slice only with its sender's signature
  over its hash.
* An owner's part statement also binds the digest of the hashes of the slices it reduced
  (:func:`~protolearn.protocol.statements.inputs_digest`). A backup taking over never sums the first
  owner's own slice (it may hold it now), so the rule that only ``peers[j]`` signs a set with
  ``peers[j]`` in still holds.
* Before committing, the checker of ``j`` (and an owner relaying a dead owner's part) recomputes every
  counting part over ``C`` that another peer signed, from the slices it holds (the same pure function).
  It commits only once each such part checked out, or its missing slices are from dead contributors.
* A mismatch is a **veto**: the checker signs a fin whose result hash is
  :func:`~protolearn.protocol.statements.veto_digest` of the refused statement (no committed result has
  it), sends it with that statement to every peer, and fails with
  :attr:`~.actions.Failed.reducer_faults`: the reducer's signed statement and every contributor's signed
  slice (:mod:`protolearn.protocol.reducer_check`), which a third party checks without trusting the
  checker. If the reducer's inputs digest is not that of the slices the checker holds, the checker
  cannot tell the reducer from an equivocating contributor: it vetoes without a proof.
* A replica that receives a veto whose hash matches the statement it carries fails at once. An honest
  checker is never dead to an honest replica (T; the adapter answers a late probe of a vetoed round with
  the veto, never with "left"), and its only fin is the veto, so **no honest replica finishes Done with
  a part its honest checker refused**: the round fails, is redone, and the evidence goes to the
  coordinator. A lying checker can veto an honest part (a liar can always fail a round) but its
  evidence does not verify. Owner and checker lying together still go unnoticed; that is the residual
  the statistical monitors and robust aggregation are for.
* Cost: scatter bytes double (each slice goes to two replicas), about 1.5x a round's bytes in all, plus a
  SHA-256 of the vector and one signature per part at each contributor and one extra reduction per part at
  each checker.

:class:`CrossCheck` holds one replica's side of it: the signed slice hashes it holds (its own too), the
inputs digest it signs as an owner, and the recomputation that finds a wrong part. The round sends the
slices and the veto (:mod:`.round`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protolearn.protocol.collective.part_ledger import SignedPart
from protolearn.protocol.collective.spec import RoundSpec
from protolearn.protocol.reducer_check import ReducerFault, make_fault
from protolearn.protocol.statements import HASH_BYTES, SIGNATURE_BYTES, inputs_digest, part_hash, slice_statement


class Veto(NamedTuple):
    """A part this replica refuses: index, the counting part, the proof if it has one, and why."""

    part: int
    refused: SignedPart
    fault: ReducerFault | None
    reason: str


@dataclass
class CrossCheck:
    """One replica's cross-check of a round (off unless ``spec.cross_check``); ``slices``: the round's held
    slices, part -> contributor -> slice, which the round fills."""

    spec: RoundSpec
    slices: Mapping[int, Mapping[str, torch.Tensor]]
    # part -> contributor -> (hash of its slice, its signature); mine too.
    proofs: dict[int, dict[str, tuple[bytes, bytes]]] = field(default_factory=dict)
    # (part, hash, inputs) of the parts found to be the reduction of their slices.
    checked: set[tuple[int, bytes, bytes]] = field(default_factory=set)

    def check_slice(self, peer: str, part: int, data_digest: bytes, signer: str, digest: bytes, signature: bytes) -> str:
        """Why a scattered slice whose bytes hash to ``data_digest`` must be refused ('' if not)."""
        if signer != peer or len(digest) != HASH_BYTES or len(signature) != SIGNATURE_BYTES:
            return f"scatter of part {part} must carry its sender's {HASH_BYTES}-byte hash and {SIGNATURE_BYTES}-byte signature"
        if data_digest != digest:
            return f"scatter of part {part}: the bytes do not hash to the signed hash"
        if not self.spec.verify(peer, slice_statement(self.spec.digest, part, digest), signature):
            return f"scatter of part {part}: the signature does not verify as the sender's"
        return ""

    def keep(self, part: int, peer: str, digest: bytes, signature: bytes) -> None:
        self.proofs.setdefault(part, {})[peer] = (digest, signature)

    def my_proof(self, part: int, data: torch.Tensor) -> tuple[bytes, bytes]:
        """The hash of my slice ``data`` of ``part`` and my signature of it (signed once)."""
        mine = self.proofs.setdefault(part, {})
        me = self.spec.me
        if me not in mine:
            digest = part_hash(data)
            mine[me] = (digest, self.spec.sign(slice_statement(self.spec.digest, part, digest)))
        return mine[me]

    def inputs(self, part: int, members: frozenset[str]) -> bytes:
        """The inputs digest a part over ``members`` binds: the digest of their slices' hashes ('' when off)."""
        if not self.spec.cross_check:
            return b""
        proofs = self.proofs.get(part, {})
        return inputs_digest([proofs[p][0] for p in sorted(members)])

    def review(self, parts: Iterable[tuple[int, SignedPart]], members: frozenset[str], dead: Collection[str]) -> tuple[bool, Veto | None]:
        """Recompute each counting part over ``members`` in ``parts`` from the slices held: (every part checked,
        the first wrong one). A part whose missing slices are all from dead contributors is taken as it is."""
        complete = True
        for j, p in parts:
            if p.signer == self.spec.me or (j, p.digest, p.inputs) in self.checked:
                continue
            held = self.slices.get(j, {})
            missing = [c for c in members if c not in held]
            if missing:
                if all(c in dead for c in missing):
                    self.checked.add((j, p.digest, p.inputs))
                else:
                    complete = False
                continue
            if self.inputs(j, members) != p.inputs:
                return False, Veto(j, p, None, f"{p.signer} signed part {j} as the reduction of other slices than its "
                                               "contributors sent this replica (the reducer or a contributor lied)")
            if part_hash(self.spec.reduce(held, members, j)) != p.digest:
                fault = make_fault(self.spec.round_id, self.spec.weights, self.spec.numel, self.spec.op, j, sorted(members), p.signer, p.inputs,
                                   p.digest, p.signature, [(c, held[c], self.proofs[j][c][1]) for c in sorted(members)])
                return False, Veto(j, p, fault, f"{p.signer} signed part {j} of round {self.spec.round_id} with bytes that are "
                                                "not the reduction of the slices it signed for")
            self.checked.add((j, p.digest, p.inputs))
        return complete, None
