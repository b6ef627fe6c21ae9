"""The signed statements of a collective round: what a replica signs, and the evidence a lie leaves.

A :class:`~protolearn.protocol.collective.CollectiveRound` signs two kinds of statement, each over fixed,
length-prefixed bytes (never over a serialised object, so two encoders cannot disagree and nothing is
ever deserialised to check one):

* a **part**: "part ``j`` of this round, reduced over contributor set ``S``, hashes to ``h``", signed by
  the replica that reduced it. It travels with the part, also when another replica relays it, so any
  receiver can check who produced the bytes it holds;
* a **fin**: "I committed this round over contributor set ``C`` with result hash ``H``", signed by the
  replica that committed;
* a **slice** (only in a round with the reducer cross-check): "my slice of part ``j`` of this round hashes
  to ``h``", signed by its contributor. A part's statement then also binds its **inputs**: the
  :func:`inputs_digest` of the hashes of the slices the reducer summed, so that the reducer cannot later
  claim to have reduced other slices, and a checker's evidence cannot frame it with other ones.

A replica that finds a part it can check is not the reduction of the inputs its reducer signed **vetoes**
the round: it signs a fin whose result hash is :func:`veto_digest` of the reducer's statement (a hash no
committed result ever has), so no honest replica that needs its fin can finish with that part.

Both name the round by its :func:`round_digest` (the round id, the vector's length, the operation and
every participant with its weight), so a statement from another round, or from another stage's round
of the same id (other participants), never checks out here. A set is written as a bitmask over the
round's participants in sorted order; a hash is SHA-256 (:func:`part_hash` of a part's float32 bytes,
and :func:`result_hash` of the concatenated part hashes, which binds the whole result as tightly as a
hash of its bytes would, without hashing them twice).

Two signatures of one peer over different hashes for the same (round, part, set), or over two different
fins of one round, prove that it lied to someone: :class:`SignedStatement` keeps such a statement with its
signature, so that a third party (the coordinator) can check it with :func:`verify_ed25519` alone.

The signing key stays outside: a round gets a ``sign(data) -> signature`` and a
``verify(peer, data, signature) -> bool``, so that this module and the round stay pure and unit tests
can use fake keys. :func:`verify_ed25519` is the real ``verify`` (libp2p peer IDs embed their Ed25519 key).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import SIGNATURE_BYTES, public_key_from_peer_id

if TYPE_CHECKING:  # a part is a tensor; the coordinator checks statements without loading torch
    import torch

HASH_BYTES = 32
# Domain separation: a signature made for one of these can never pass for the other, or for anything
# else the same key signs (spot checks, coordinator messages).
_PART = b"protolearn/collective/part/1\x00"
_FIN = b"protolearn/collective/fin/1\x00"
_ROUND = b"protolearn/collective/round/1\x00"
_RESULT = b"protolearn/collective/result/1\x00"
_SLICE = b"protolearn/collective/slice/1\x00"
_INPUTS = b"protolearn/collective/inputs/1\x00"
_VETO = b"protolearn/collective/veto/1\x00"

Sign = Callable[[bytes], bytes]
Verify = Callable[[str, bytes, bytes], bool]

__all__ = [
    "HASH_BYTES", "SIGNATURE_BYTES", "SignedStatement", "Sign", "Verify", "contradiction", "fin_statement", "inputs_digest",
    "is_part_statement", "members_mask", "op_tag", "part_hash", "part_statement", "result_hash", "round_digest", "slice_statement", "verify_ed25519",
    "veto_digest",
]


def round_digest(round_id: int, weights: Mapping[str, float], numel: int, op: str) -> bytes:
    """What every statement of a round is bound to: the round id, its parameters and its participants."""
    h = hashlib.sha256(_ROUND)
    h.update(struct.pack(">QQH", round_id, numel, len(op)) + op.encode())
    for peer in sorted(weights):
        raw = peer.encode()
        h.update(struct.pack(">H", len(raw)) + raw + struct.pack(">d", weights[peer]))
    return h.digest()


def op_tag(op: str, rule_tag: str = "mean", cross_check: bool = False, compression: str = "none") -> str:
    """What a round's digest names as its operation: ``op``, the aggregation rule with its parameters unless it
    is the mean, whether slices are cross-checked, and the slice compression unless it is none (a plain mean
    round's digest is what it always was)."""
    return (op + ("" if rule_tag == "mean" else f"/{rule_tag}") + ("/xc" if cross_check else "")
            + ("" if compression == "none" else f"/z:{compression}"))


def members_mask(peers: Sequence[str], members: Collection[str]) -> bytes:
    """``members`` as a bitmask over the sorted ``peers`` (bit k of byte k // 8 is ``peers[k]``)."""
    mask = bytearray((len(peers) + 7) // 8)
    for k, p in enumerate(peers):
        if p in members:
            mask[k // 8] |= 1 << (k % 8)
    return bytes(mask)


def part_hash(part: torch.Tensor) -> bytes:
    """SHA-256 of a float32 part's bytes, read in place (hashlib releases the GIL: fine in a worker thread)."""
    flat = part.detach().contiguous().reshape(-1)  # (L,)
    return hashlib.sha256(flat.numpy().view("uint8") if flat.numel() else b"").digest()


def result_hash(part_hashes: Sequence[bytes]) -> bytes:
    """The hash of a whole result, from its parts' hashes in part order."""
    return hashlib.sha256(_RESULT + b"".join(part_hashes)).digest()


def part_statement(round_dig: bytes, part: int, mask: bytes, digest: bytes, inputs: bytes = b"") -> bytes:
    """The bytes a reducer signs for part ``part`` over the set ``mask`` with hash ``digest`` (and, in a
    cross-checked round, the :func:`inputs_digest` of the slices it reduced; the hash stays last)."""
    return _PART + round_dig + struct.pack(">IH", part, len(mask)) + mask + inputs + digest


def slice_statement(round_dig: bytes, part: int, digest: bytes) -> bytes:
    """The bytes a contributor signs for its slice of part ``part`` with hash ``digest``."""
    return _SLICE + round_dig + struct.pack(">I", part) + digest


def inputs_digest(slice_hashes: Sequence[bytes]) -> bytes:
    """What a cross-checked part's statement binds: the hashes of its slices, in sorted contributor order."""
    return hashlib.sha256(_INPUTS + b"".join(slice_hashes)).digest()


def is_part_statement(statement: bytes, round_dig: bytes) -> bool:
    """Whether ``statement`` is (shaped like) a part statement of the round with digest ``round_dig``."""
    return statement.startswith(_PART + round_dig)


def veto_digest(statement: bytes) -> bytes:
    """The result hash of a vetoing fin: bound to the part statement it refuses, never a real result's hash."""
    return hashlib.sha256(_VETO + statement).digest()


def fin_statement(round_dig: bytes, mask: bytes, digest: bytes) -> bytes:
    """The bytes a replica signs when it commits over the set ``mask`` with result hash ``digest``."""
    return _FIN + round_dig + struct.pack(">H", len(mask)) + mask + digest


def contradiction(a: bytes, b: bytes) -> str:
    """Why two statements one peer signed cannot both be honest ("" if they can).

    Two part statements for the same round, part and contributor set with different hashes, or two
    different fins of one round, are a lie told to someone: that, with both signatures checking out
    against the peer's key, is proof a third party can act on. Any other pair proves nothing.
    """
    if a == b:
        return ""
    digest = HASH_BYTES
    if a.startswith(_PART) and b.startswith(_PART) and len(a) == len(b) and a[:-digest] == b[:-digest]:
        return "signed two different values of one reduced part"
    round_end = len(_FIN) + HASH_BYTES  # a round digest is a SHA-256
    if a.startswith(_FIN) and b.startswith(_FIN) and len(a) > round_end and a[:round_end] == b[:round_end]:
        return "signed two different results of one round"
    return ""


@dataclass(frozen=True)
class SignedStatement:
    """A statement ``peer`` signed: with another one of the same peer, proof that it told two stories."""

    peer: str
    statement: bytes
    signature: bytes
    what: str


@lru_cache(maxsize=4096)
def _public_key(peer: str) -> Ed25519PublicKey | None:
    try:
        return Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer))
    except (ProtocolError, ValueError):
        return None


def verify_ed25519(peer: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``peer``'s Ed25519 signature of ``data`` (the key comes from the peer ID)."""
    key = _public_key(peer)
    if key is None or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        key.verify(signature, data)
    except InvalidSignature:
        return False
    return True
