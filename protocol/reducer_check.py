"""Proof that a collective reducer signed a wrong part, and its check by a third party (the coordinator).

In a round with the reducer cross-check (:class:`~protolearn.protocol.collective.CollectiveRound` with
``cross_check=True``) every contributor signs its slice of each part (:func:`~.statements.slice_statement`)
and sends it to the part's owner and to the owner's successor, the **checker**. The owner signs its reduced
part together with the digest of the slice hashes it reduced (:func:`~.statements.inputs_digest`). A checker
that holds the same slices recomputes the part; if the bytes differ it vetoes the round and keeps a
:class:`ReducerFault`:

* the round's parameters (id, vector length, operation, participants and their weights), from which the
  verifier recomputes the round digest every statement is bound to, with the aggregation rule of the run;
* the reducer's signed statement: (round, part, contributor set ``S``, inputs digest, part hash);
* every slice of ``S``, with its contributor's signature.

In a round with a slice compression (``[sync] compression``, :mod:`~protolearn.protocol.sync_compression`)
a slice is the contributor's contribution as it signed it (float32, the values its encoding carried), and
the reduction ends with the compression's projection of the reduced part, which the verifier applies too.

:func:`verify_reducer_fault` needs no trust in the accuser: the reducer's signature shows it vouched for
exactly these slices (their hashes give its inputs digest) and for the part hash; the contributors'
signatures show the slices are theirs; recomputing the reduction (a pure function of ``S`` and the slices,
:mod:`.robust`) gives bytes whose hash is not the one the reducer signed. An accuser cannot frame an honest
reducer with a slice of its own that differs from the one it sent, since the reducer's inputs digest would
not match. The message decodes without torch (the coordinator starts without it); only
:func:`verify_reducer_fault` loads it, to recompute. The evidence is hostile input: every count and length is checked against the round before any
tensor is built, and nothing is deserialised except the flat float32 bytes of the slices.

Wire size (msgpack envelope, :func:`~.wire.encode`): for a part of ``L`` floats reduced over ``k``
contributors among ``n`` participants, about ``k * (4 L + 130) + n * 60 + 250`` bytes, i.e. about the
whole vector's size when every replica contributes (measured for a 1M-float vector: 4,001,122 bytes with
3 replicas, parts of 333,334 floats; 4,002,429 bytes with 8, parts of 125,000).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import Field

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import public_key_from_peer_id
from protolearn.protocol.bounds import MAX_PARTICIPANTS, MAX_PEER_ID, PeerId, Step
from protolearn.protocol.statements import (
    HASH_BYTES,
    SIGNATURE_BYTES,
    inputs_digest,
    members_mask,
    op_tag,
    part_statement,
    round_digest,
    slice_statement,
)
from protolearn.protocol.wire import MAX_MESSAGE_BYTES, Message

if TYPE_CHECKING:  # the coordinator decodes evidence without torch; only verifying it loads torch
    import torch

# All slices of one fault together: one message must carry them, with room for the rest.
MAX_FAULT_BYTES = MAX_MESSAGE_BYTES - (1 << 20)
MAX_NUMEL = 1 << 40

__all__ = ["MAX_FAULT_BYTES", "ReducerFault", "SignedSlice", "make_fault", "peer_id_public_key", "verify_reducer_fault"]


class SignedSlice(Message):
    """One contributor's slice of the part: raw float32 bytes (native little-endian) and its signature."""

    peer: PeerId
    data: Annotated[bytes, Field(max_length=MAX_FAULT_BYTES)]
    signature: Annotated[bytes, Field(max_length=SIGNATURE_BYTES)]


class ReducerFault(Message):
    """Evidence that ``reducer`` signed part ``part`` of a round with bytes that are not the reduction of the
    slices it signed for (see the module docstring). A node sends it to the coordinator as is."""

    KIND: ClassVar[str] = "collective.reducer_fault"
    round: Step
    numel: Annotated[int, Field(ge=0, le=MAX_NUMEL)]
    op: Literal["sum", "weighted_mean"]
    participants: list[PeerId] = Field(max_length=MAX_PARTICIPANTS)
    weights: list[float] = Field(max_length=MAX_PARTICIPANTS)
    part: Annotated[int, Field(ge=0, lt=MAX_PARTICIPANTS)]
    members: list[PeerId] = Field(max_length=MAX_PARTICIPANTS)
    reducer: Annotated[str, Field(min_length=1, max_length=MAX_PEER_ID)]
    inputs: Annotated[bytes, Field(max_length=HASH_BYTES)]
    digest: Annotated[bytes, Field(max_length=HASH_BYTES)]
    signature: Annotated[bytes, Field(max_length=SIGNATURE_BYTES)]
    slices: list[SignedSlice] = Field(max_length=MAX_PARTICIPANTS)


def make_fault(
    round_id: int, weights: Mapping[str, float], numel: int, op: str, part: int, members: Sequence[str], reducer: str,
    inputs: bytes, digest: bytes, signature: bytes, slices: Sequence[tuple[str, torch.Tensor, bytes]],
) -> ReducerFault:
    """The evidence a checker keeps; ``slices`` are (contributor, float32 slice, its signature) in sorted order."""
    peers = sorted(weights)
    return ReducerFault(
        round=round_id, numel=numel, op=op, participants=peers, weights=[float(weights[p]) for p in peers], part=part,  # type: ignore[arg-type]
        members=list(members), reducer=reducer, inputs=inputs, digest=digest, signature=signature,
        slices=[SignedSlice(peer=p, data=t.detach().contiguous().numpy().tobytes(), signature=s) for p, t, s in slices],
    )


def peer_id_public_key(peer: str) -> bytes | None:
    """The raw Ed25519 key inlined in a libp2p peer ID (None if there is none): a ``public_key_of`` to pass."""
    try:
        return public_key_from_peer_id(peer)
    except (ProtocolError, ValueError):
        return None


def _signed(public_key_of: Callable[[str], bytes | None], peer: str, data: bytes, signature: bytes) -> bool:
    raw = public_key_of(peer)
    if raw is None or len(raw) != 32 or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def _part_bounds(numel: int, n: int, part: int) -> tuple[int, int]:
    # ownership.part_bounds for one part, without importing torch.
    base, extra = divmod(numel, n)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def _shape_error(ev: ReducerFault) -> str:
    """Why ``ev`` is malformed ('' if it is not), from counts and lengths alone."""
    n = len(ev.participants)
    if n == 0 or len(ev.weights) != n:
        return "participants and weights must be non-empty and of the same length"
    if ev.participants != sorted(set(ev.participants)):
        return "participants must be sorted and distinct"
    if not all(math.isfinite(w) and w >= 0 for w in ev.weights):
        return "weights must be finite and non-negative"
    if ev.part >= n:
        return f"part {ev.part} is out of range for {n} participants"
    weight = dict(zip(ev.participants, ev.weights))
    if not ev.members or ev.members != sorted(set(ev.members)) or not all(weight.get(p, 0.0) > 0 for p in ev.members):
        return "members must be sorted, distinct participants with a positive weight"
    if ev.reducer not in weight:
        return f"reducer {ev.reducer[:64]!r} is not a participant"
    if len(ev.inputs) != HASH_BYTES or len(ev.digest) != HASH_BYTES or len(ev.signature) != SIGNATURE_BYTES:
        return "the reducer's statement must carry 32-byte digests and a 64-byte signature"
    if [s.peer for s in ev.slices] != ev.members:
        return "there must be exactly one slice per member, in member order"
    a, b = _part_bounds(ev.numel, n, ev.part)
    if any(len(s.data) != 4 * (b - a) for s in ev.slices):
        return f"every slice of part {ev.part} must be {b - a} float32 values"
    if 4 * (b - a) * len(ev.slices) > MAX_FAULT_BYTES:
        return f"the slices exceed {MAX_FAULT_BYTES} bytes"
    return ""


def verify_reducer_fault(
    evidence: ReducerFault, public_key_of: Callable[[str], bytes | None], *, aggregation_cfg: Any, compression: str = "none"
) -> tuple[bool, str]:
    """Whether ``evidence`` proves that its reducer signed a wrong part, with the reason either way.

    ``public_key_of(peer)``: a peer's raw Ed25519 public key, or None if unknown (e.g.
    :func:`peer_id_public_key`). ``aggregation_cfg``: the run's aggregation, a :class:`~.robust.Aggregation` or the
    run config's ``integrity`` section; ``compression``: the run's ``[sync] compression``
    (:mod:`protolearn.sync_spec`), whose projection of a reduced part is part of the reduction. A round that
    used another rule or compression does not verify (its statements are bound to them).
    """
    import torch

    from protolearn.protocol.collective.robust import Aggregation, robust_reduce
    from protolearn.protocol.statements import part_hash
    from protolearn.protocol.sync_compression.slice_codec import slice_codec
    from protolearn.sync_spec import SyncSpecError, parse_sync_compression

    why = _shape_error(evidence)
    if why:
        return False, f"malformed evidence: {why}"
    agg = aggregation_cfg if isinstance(aggregation_cfg, Aggregation) else Aggregation.from_config(aggregation_cfg)
    try:
        codec = slice_codec(parse_sync_compression(compression))
    except SyncSpecError as err:
        return False, f"the run's compression cannot check this evidence: {err}"
    ev = evidence
    weights = dict(zip(ev.participants, ev.weights))
    if ev.op == "weighted_mean" and sum(weights.values()) <= 0:
        return False, "malformed evidence: a weighted mean needs a positive weight"
    rd = round_digest(ev.round, weights, ev.numel, op_tag(ev.op, agg.tag, True, "none" if codec is None else codec.tag))
    statement = part_statement(rd, ev.part, members_mask(ev.participants, ev.members), ev.digest, ev.inputs)
    if not _signed(public_key_of, ev.reducer, statement, ev.signature):
        return False, f"the part statement is not signed by {ev.reducer} (or belongs to another round or aggregation rule)"
    hashes = []
    for s in ev.slices:
        h = hashlib.sha256(s.data).digest()
        if not _signed(public_key_of, s.peer, slice_statement(rd, ev.part, h), s.signature):
            return False, f"the slice of {s.peer} is not signed by {s.peer}"
        hashes.append(h)
    if inputs_digest(hashes) != ev.inputs:
        return False, f"the slices are not the ones {ev.reducer} signed for"
    a, b = _part_bounds(ev.numel, len(ev.participants), ev.part)
    tensors = {s.peer: torch.frombuffer(bytearray(s.data), dtype=torch.float32) for s in ev.slices}  # (L,) each
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        return False, "a slice holds NaN or Inf (the collective refuses those)"
    reduced = robust_reduce(tensors, ev.members, weights, ev.op, b - a, agg)
    if part_hash(reduced if codec is None else codec.reduced(reduced)) == ev.digest:
        return False, f"part {ev.part} signed by {ev.reducer} is the reduction of the slices: no fault"
    return True, f"{ev.reducer} signed part {ev.part} of round {ev.round} with bytes that are not the {agg.rule} of its contributors' signed slices"
