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

What an ack does not bind is the *attempt*: a ticket redone after its step reopened, along the same
route and with the same loss, has the same statement, so stage 0 could hand in the earlier attempt's
ack without running the new one. The route must still be live, and a replica on it that lacks the
ticket's gradients asks to redo it again, so this costs redos (bounded by the coordinator's redo caps)
and, at worst, tickets logged as lost at the last revision; binding acks to a per-lease nonce carried in
the activation would close it.

The statement is fixed, length-prefixed bytes with a domain tag, never a serialised object (see
``statements.py``): a signature made for a collective part or fin can never pass for an ack, nor one
from another run (the run hash is in it), step, ticket, route or loss (its float64 bits are in it).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_ACK = b"protolearn/pipeline/ack/1\x00"

__all__ = ["ack_statement"]


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">H", len(raw)) + raw


def ack_statement(run_hash: str, step: int, ticket: int, route: Sequence[str], loss: float) -> bytes:
    """The bytes the last stage signs for ticket ``(step, ticket)`` that went along ``route`` with ``loss``."""
    out = [_ACK, _text(run_hash), struct.pack(">QIH", step, ticket, len(route))]
    out += [_text(peer) for peer in route]
    out.append(struct.pack(">d", loss))
    return b"".join(out)
