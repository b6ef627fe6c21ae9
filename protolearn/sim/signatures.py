"""Signatures of simulated nodes: a keyed hash stands in for Ed25519.

Only code that holds a peer's name can make that peer's signature here, and checking one costs a hash,
so the real cores' signature checks (the last stage's ack of a completion, evidence, fins) run at the
speed a simulation of thousands of nodes needs. The real identities are Ed25519 keys
(:mod:`protolearn.protocol.identity`).
"""

from __future__ import annotations

import hashlib
import hmac


def sim_sign(peer: str, data: bytes) -> bytes:
    """``peer``'s signature of ``data``."""
    return hashlib.sha256(peer.encode() + b"\x00" + data).digest()


def sim_verify(peer: str, data: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(signature, sim_sign(peer, data))
