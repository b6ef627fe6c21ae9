"""Termination of a collective round: the signed fins a replica sends and collects.

The rule is the round's "Termination" (:mod:`.round`): a committed replica signs a fin of its ``C`` and
result hash (:func:`~protolearn.protocol.statements.fin_statement`) for every peer, and is finished only
once it holds a fin from every peer that is not dead to it; a fin from a peer that is not dead with
another ``C`` or hash, or a second, different fin from one peer, fails the round with the signed fins
as evidence. A veto (:mod:`.cross_check`) is a fin whose hash no committed result has.
:class:`FinBook` keeps one round's fins at one replica and applies these checks; the claim that honest
replicas never diverge (:mod:`protolearn.protocol.collective`) rests on them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from protolearn.protocol.collective.spec import RoundSpec
from protolearn.protocol.statements import HASH_BYTES, SIGNATURE_BYTES, SignedStatement, fin_statement, is_part_statement, veto_digest


@dataclass(frozen=True)
class Fin:
    """A replica's signed word that it committed ``members`` with result hash ``digest`` (or, for a veto,
    that it refuses the part whose statement hashes to ``digest``)."""

    members: frozenset[str]
    digest: bytes
    signature: bytes


@dataclass
class FinBook:
    """The fins of one round at one replica: the peers' it received, and the ones it signs."""

    spec: RoundSpec
    received: dict[str, Fin] = field(default_factory=dict)

    def statement(self, members: Collection[str], digest: bytes) -> bytes:
        return fin_statement(self.spec.digest, self.spec.mask(members), digest)

    def signed(self, members: frozenset[str], digest: bytes) -> Fin:
        """The fin this replica signs for ``members`` and ``digest``."""
        return Fin(members, digest, self.spec.sign(self.statement(members, digest)))

    def check(self, peer: str, members: frozenset[str], digest: bytes, signature: bytes, vetoed: bytes) -> str:
        """Why a fin from ``peer`` must be refused ('' if not); ``vetoed``: the part statement a veto refuses."""
        if len(digest) != HASH_BYTES or len(signature) != SIGNATURE_BYTES:
            return f"fin must carry a {HASH_BYTES}-byte result hash and a {SIGNATURE_BYTES}-byte signature"
        if not self.spec.verify(peer, self.statement(members, digest), signature):
            return "fin's signature does not verify as the sender's"
        if vetoed and (veto_digest(vetoed) != digest or not is_part_statement(vetoed, self.spec.digest)):
            return "a vetoing fin's hash must be the veto digest of a part statement of this round"
        return ""

    def keep(self, peer: str, fin: Fin) -> Fin | None:
        """Keep ``peer``'s fin; the one it sent before if that one differs (it signed two)."""
        old = self.received.setdefault(peer, fin)
        return None if old == fin else old

    def evidence(self, peer: str, fin: Fin) -> SignedStatement:
        return SignedStatement(peer, self.statement(fin.members, fin.digest), fin.signature, f"fin of round {self.spec.round_id}")

    def disagreeing(self, mine: Fin, dead: Collection[str]) -> list[str]:
        """Peers not dead here whose fin names another contributor set or result than ``mine``."""
        return sorted(p for p, f in self.received.items() if (f.members, f.digest) != (mine.members, mine.digest) and p not in dead)

    def all_in(self, me: str, dead: Collection[str]) -> bool:
        """Whether every peer but ``me`` sent its fin or is dead."""
        return all(p in self.received or p in dead for p in self.spec.peers if p != me)

    def __contains__(self, peer: object) -> bool:
        return peer in self.received
