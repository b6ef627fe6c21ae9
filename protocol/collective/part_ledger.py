"""The signed reduced parts a collective replica holds, and which of them count toward its result.

:class:`~protolearn.protocol.collective.CollectiveRound` keeps every reduced part it receives (or reduces)
here, keyed by part index, contributor set and signer, and asks which of them **count**: which it may
commit and intersect its contributor set ``C`` with. The rules are the ones the round's correctness
argument names; they need the round's view of who is out and who owns what, and nothing else:

* :meth:`PartLedger.check` refuses a part before it is kept: a signer that is not a participant, a hash
  or signature of the wrong size, bytes that do not hash to the signed hash, a signature that does not
  verify over (round digest, part, set, inputs, hash), inputs of the wrong size for the round, more than ``MAX_VERSIONS_PER_SIGNER`` sets from one signer
  for one part, or a set with the part's first owner in that the first owner did not sign (it never
  sends its own slice of its own part, so nobody else can sum it).
* A kept part of ``j`` over ``S`` counts once (a) its signer is no later in ``j``'s chain than the owner
  of ``j`` in the round's eyes, and (b) every contributor that ``S`` leaves out is out in the round's eyes
  (:meth:`PartLedger.settle`). A part that does not count yet is held: it may once the round finds
  those peers out.
* One signer with two hashes for the same (part, set), or two counting parts of the same (part, set) with
  different hashes, is a :class:`Conflict`; in the first case its two signed statements are the evidence.
* A part over a set that is not within ``C`` can never be committed (``C`` only shrinks), so
  :meth:`PartLedger.prune` frees it: what a liar can make a replica hold stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protolearn.protocol.statements import HASH_BYTES, SIGNATURE_BYTES, SignedStatement, Verify, members_mask, part_statement

# Parts of one part index one signer may have here at once (over different sets). An honest owner signs
# a new one each time C shrinks under it, so this bounds what a liar can make a replica hold to a few
# vectors' worth; a round that loses more contributors than this while one owner reduces fails instead.
MAX_VERSIONS_PER_SIGNER = 4


@dataclass(frozen=True)
class SignedPart:
    """A reduced part with its SHA-256 and its reducer's signature (see :func:`~.statements.part_statement`);
    ``inputs``: in a cross-checked round, the digest of the slices the reducer says it reduced."""

    data: torch.Tensor
    digest: bytes
    signer: str
    signature: bytes
    inputs: bytes = b""


class Conflict(NamedTuple):
    """Two stories about one part: who told them, why it matters, and the signed statements if one peer told both."""

    culprits: list[str]
    reason: str
    evidence: tuple[SignedStatement, ...] = ()


@dataclass
class PartLedger:
    """The signed parts of one round at one replica; ``peers`` sorted, ``contributors`` those with weight > 0."""

    round_id: int
    peers: Sequence[str]
    contributors: frozenset[str]
    round_digest: bytes
    verify: Verify
    cross_check: bool = False
    _index: dict[str, int] = field(init=False)
    _held: dict[int, dict[frozenset[str], dict[str, SignedPart]]] = field(init=False, default_factory=dict)
    _counted: dict[int, dict[frozenset[str], SignedPart]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {p: k for k, p in enumerate(self.peers)}

    def counted(self, part: int, members: frozenset[str]) -> SignedPart | None:
        """The part of ``part`` over ``members`` that counts here, if any."""
        return self._counted.get(part, {}).get(members)

    def counted_sets(self, part: int) -> list[frozenset[str]]:
        """The sets over which a part of ``part`` counts here."""
        return list(self._counted.get(part, {}))

    def statement(self, part: int, members: Collection[str], digest: bytes, inputs: bytes = b"") -> bytes:
        return part_statement(self.round_digest, part, members_mask(self.peers, members), digest, inputs)

    def check(self, part: int, members: frozenset[str], data_digest: bytes, signer: str, digest: bytes, signature: bytes,
              inputs: bytes = b"") -> str:
        """Why a received part over ``members`` whose bytes hash to ``data_digest`` must be refused ('' if not)."""
        if signer not in self._index:
            return f"part {part} is signed by {signer[:64]!r}, not a participant"
        if len(digest) != HASH_BYTES or len(signature) != SIGNATURE_BYTES:
            return f"part {part} must carry a {HASH_BYTES}-byte hash and a {SIGNATURE_BYTES}-byte signature"
        if len(inputs) != (HASH_BYTES if self.cross_check else 0):
            return f"part {part} must carry {'a' if self.cross_check else 'no'} {HASH_BYTES}-byte inputs digest in this round"
        primary = self.peers[part]
        if signer != primary and primary in members:
            return f"part {part} over a set with {primary} in is signed by {signer}, not by {primary}"
        if data_digest != digest:
            return f"part {part}'s bytes do not hash to the hash {signer} signed"
        by_set = self._held.get(part, {})
        old = by_set.get(members, {}).get(signer)
        if old is not None and old.digest == digest and old.signature == signature and old.inputs == inputs:
            return ""  # the same part again (relayed, say): nothing new to check
        if old is None and sum(signer in s for s in by_set.values()) >= MAX_VERSIONS_PER_SIGNER:
            return f"{signer} signed more than {MAX_VERSIONS_PER_SIGNER} versions of part {part}"
        if not self.verify(signer, self.statement(part, members, digest, inputs), signature):
            return f"part {part}'s signature does not verify as {signer}'s"
        return ""

    def add(self, part: int, members: frozenset[str], p: SignedPart) -> Conflict | None:
        """Keep a checked part (or one reduced here); a second hash from the same signer is a conflict."""
        old = self._held.setdefault(part, {}).setdefault(members, {}).setdefault(p.signer, p)
        if old.digest == p.digest:
            return None
        return Conflict([p.signer], f"{p.signer} signed two different parts {part} over the same contributors in round {self.round_id}",
                        (self.evidence(part, members, old), self.evidence(part, members, p)))

    def settle(self, out: Collection[str], owner: Callable[[int], str]) -> tuple[frozenset[str], Conflict | None]:
        """Count what now counts; returns the intersection of the sets of every counting part (at most the
        contributors), and the first conflict between two counting parts, if any."""
        meet = self.contributors
        n = len(self.peers)
        for j, by_set in self._held.items():
            owner_at = (self._index[owner(j)] - j) % n
            for members, by_signer in by_set.items():
                if not all(p in out for p in self.contributors - members):  # (b)
                    continue
                for signer, p in by_signer.items():
                    if (self._index[signer] - j) % n > owner_at:  # (a)
                        continue
                    counted = self._counted.setdefault(j, {}).setdefault(members, p)
                    if counted.digest != p.digest:
                        return meet, Conflict(sorted({counted.signer, p.signer}),
                                              f"round {self.round_id}: {counted.signer} and {p.signer} signed different parts {j} "
                                              "over the same contributors (one of the contributors or reducers lied)")
                    meet &= members
        return meet, None

    def prune(self, within: frozenset[str]) -> None:
        """Free the parts over sets not within ``within`` (the round's C, which only shrinks)."""
        for j, by_set in self._held.items():
            for members in [m for m in by_set if not m <= within]:
                del by_set[members]
                self._counted.get(j, {}).pop(members, None)

    def evidence(self, part: int, members: Collection[str], p: SignedPart) -> SignedStatement:
        return SignedStatement(p.signer, self.statement(part, members, p.digest, p.inputs), p.signature, f"part {part} of round {self.round_id}")
