"""The last stage's acknowledgement of a ticket: what it signs, so that stage 0 cannot complete work it never did.

A ticket's completion names its route (one peer per stage) and its loss. Stage 0 reports it, but the
loss is computed by the last stage, and only the last stage knows that the ticket really went the whole
way. So the last stage signs an **ack statement** over (run hash, step, ticket, route, loss) with its
host key; the signature rides back on every ``pipeline.Gradient`` unchanged (each stage already checks
the route hop by hop), stage 0 passes it in ``coordination.Complete``, and the coordinator verifies it
against ``route[-1]``'s peer ID. A stage-0 member then cannot invent a completion: naming an honest last
hop needs that hop's signature over exactly this loss, and naming itself (or a colluder) as the last hop
is caught by the coordinator's route check (every hop must be a live member of its stage), leaving only
a lie by a colluding last stage, which the integrity checks (spot checks, monitors) are for.

**Each lease is its own attempt.** A ticket redone after its step reopened, along the same route and with
the same loss, would otherwise have the same statement, and stage 0 could hand in the earlier attempt's
ack without running the new one. So the coordinator gives every lease of a ticket a nonce,
:func:`lease_nonce`: a keyed hash (its key is derived from its own identity, so it holds across its
restarts) of the step, the revision the step closes at next, the ticket and the lease's attempt number.
The nonce travels in ``pipeline.Activation`` to the last stage, which signs it into the ack; the
coordinator accepts only the nonce of the ticket's current lease or of the few before it in the same
revision (a late completion of a lease it re-issued to the same holder), and every un-completion of a
ticket skips that many attempt numbers. An ack from before a redo or a reopening thus never completes
the new attempt. Nobody but the coordinator can make a nonce, and a nonce says nothing but "this lease".

The statement is fixed, length-prefixed bytes with a domain tag, never a serialised object (see
``statements.py``): a signature made for a collective part or fin can never pass for an ack, nor one
from another run (the run hash is in it), step, ticket, route or loss (its float64 bits are in it).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

from protolearn.protocol.bounds import NONCE_BYTES

_ACK = b"protolearn/pipeline/ack/2\x00"
_NONCE = b"protolearn/lease/nonce/1\x00"

__all__ = ["ack_statement", "lease_nonce"]


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">H", len(raw)) + raw


def ack_statement(run_hash: str, step: int, ticket: int, route: Sequence[str], loss: float, nonce: bytes) -> bytes:
    """The bytes the last stage signs for ticket ``(step, ticket)`` that went along ``route`` with ``loss``,
    leased with ``nonce``."""
    out = [_ACK, _text(run_hash), struct.pack(">QIH", step, ticket, len(route))]
    out += [_text(peer) for peer in route]
    out.append(struct.pack(">dB", loss, len(nonce)) + nonce)
    return b"".join(out)


def lease_nonce(key: bytes, step: int, revision: int, ticket: int, attempt: int) -> bytes:
    """The nonce of lease ``attempt`` of ticket ``(step, ticket)`` while the step closes next at ``revision``."""
    msg = _NONCE + struct.pack(">QIIQ", step, revision, ticket, attempt)
    return hmac.new(key, msg, hashlib.sha256).digest()[:NONCE_BYTES]
