"""The collective's one wire message: the header of every message of a round.

A round's messages travel on the protocol named :data:`protolearn.protocol.pipeline.COLLECTIVE`, with
the rest of that exchange (``ResultRequest``, ``Ack``, ``Refuse``): the node-to-node protocol names
have one owner there. Each message is a :class:`PartHeader`, followed by the part for scatter and gather
(its raw float32 bytes, or in a compressed round the blob of :mod:`protolearn.protocol.sync_compression.wire`);
a fin and a probe are the header alone. Every field is bounded, so a peer cannot
make a replica allocate past the round's own size before the round has checked what it sent.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from protolearn.protocol.bounds import MAX_PARTICIPANTS, MAX_PEER_ID, PeerId, StageIndex, Step
from protolearn.protocol.statements import HASH_BYTES, SIGNATURE_BYTES
from protolearn.protocol.wire import Message

# A part statement: domain, round digest, part and mask length, mask, inputs digest, hash.
MAX_STATEMENT_BYTES = 64 + HASH_BYTES + 6 + MAX_PARTICIPANTS // 8 + 2 * HASH_BYTES


class PartHeader(Message):
    """Precedes a part (scatter/gather: a raw float32 tensor or a compressed blob follows) or is alone (fin, probe).

    ``contributors``: for gather, whose vectors the part sums; for fin, the sender's committed set.
    ``suspects``: peers the sender holds to be out (a claim: it makes the receiver probe them).
    ``signer``, ``digest``, ``signature``: for gather, the reducer, the part's SHA-256 and the reducer's
    signature of it (:func:`~protolearn.protocol.statements.part_statement`; the sender may relay
    another's part); for fin, the sender, its result hash and its signature
    (:func:`~protolearn.protocol.statements.fin_statement`); for scatter in a cross-checked round, the
    contributor, its slice's SHA-256 and its signature (:func:`~protolearn.protocol.statements.slice_statement`).
    ``inputs``: for gather in a cross-checked round, the digest of the slices the reducer reduced.
    ``vetoed``: for a vetoing fin, the part statement it refuses (its hash is the fin's result hash).
    """

    KIND: ClassVar[str] = "collective.part"
    round: Step
    stage: StageIndex
    phase: Literal["scatter", "gather", "fin", "probe"]
    part: Annotated[int, Field(ge=0, lt=MAX_PARTICIPANTS)]
    contributors: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    suspects: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    signer: Annotated[str, Field(max_length=MAX_PEER_ID)] = ""
    digest: Annotated[bytes, Field(max_length=HASH_BYTES)] = b""
    signature: Annotated[bytes, Field(max_length=SIGNATURE_BYTES)] = b""
    inputs: Annotated[bytes, Field(max_length=HASH_BYTES)] = b""
    vetoed: Annotated[bytes, Field(max_length=MAX_STATEMENT_BYTES)] = b""
