"""Whether a completion carries the last stage's acknowledgement of the current lease (sans-IO).

Only the last stage knows that a ticket went the whole way and what its loss was, so it signs the route
and the loss (``protocol/acks.py``). The signature also covers the lease nonce the ticket travelled with:
the coordinator's keyed hash of (step, the revision the step closes at next, ticket, attempt), so an ack
from before a redo or a reopening of the ticket proves that earlier attempt, never this one (issue 27,
rule 7). The key is the coordinator's, derived from its identity, so leases survive its restart.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from protolearn.coordinator.core.tickets import ACK_ATTEMPTS, TicketLedger
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement, lease_nonce


def default_nonce_key(peer_id: str) -> bytes:
    """The nonce key of a core given none (tests, benches): derived from the coordinator's peer id."""
    return hashlib.sha256(b"protolearn/lease-nonce-key\x00" + peer_id.encode()).digest()


@dataclass
class AckDesk:
    run_hash: str
    ledger: TicketLedger
    key: bytes
    verify: Callable[[str, bytes, bytes], bool]

    def nonce(self, step: int, index: int, attempt: int | None = None) -> bytes:
        """The nonce of lease ``attempt`` (default: the latest) of ticket ``(step, index)`` in the step's next revision."""
        if attempt is None:
            attempt = self.ledger.tickets[index].issued
        return lease_nonce(self.key, step, self.ledger.next_revision(step), index, attempt)

    def refusal(self, msg: cm.Complete) -> Refusal | None:
        """Why ``msg`` may not complete its ticket (no valid ack, or the ack of an earlier lease), or None."""
        return self.signature_refusal(msg) or self._nonce_refusal(msg)

    def signature_refusal(self, msg: cm.Complete) -> Refusal | None:
        """Why ``msg`` lacks the last stage's signature of its route, loss and nonce, or None (a one-stage
        route needs none)."""
        if len(msg.route) <= 1:
            return None
        last = msg.route[-1]
        if msg.ack is None:
            return Refusal("bad_ack", f"no acknowledgement from the last stage {last}; redo the ticket")
        if not self.verify(last, ack_statement(self.run_hash, msg.step, msg.index, msg.route, msg.loss, msg.nonce), msg.ack):
            return Refusal("bad_ack", f"the acknowledgement is not the last stage {last}'s signature of this route and loss")
        return None

    def _nonce_refusal(self, msg: cm.Complete) -> Refusal | None:
        """Why the nonce ``msg``'s ack signed is not one of the ticket's last :data:`ACK_ATTEMPTS` leases, or None.
        A late completion of a lease re-issued to the same holder still counts."""
        if len(msg.route) <= 1:
            return None
        issued = self.ledger.tickets[msg.index].issued
        if any(hmac.compare_digest(msg.nonce, self.nonce(msg.step, msg.index, a)) for a in range(issued, max(0, issued - ACK_ATTEMPTS), -1)):
            return None
        return Refusal("bad_ack", f"the acknowledgement is for an earlier lease of ticket ({msg.step},{msg.index}), not a current one; redo the ticket")
