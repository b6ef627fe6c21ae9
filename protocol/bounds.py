"""The wire limits that several protocol modules share, and the bounded field types built from them.

A limit that one module alone applies stays at that module's top (STYLE.md: each protocol module starts
with its constants). The ones here bound fields that travel in messages of several protocols, so one
owner keeps, say, a peer ID that the pipeline accepts from being one the coordinator refuses.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# A libp2p peer ID is ~52 characters; this leaves room without letting a peer send a long string.
MAX_PEER_ID = 128
# Stages of one run (pipeline routes, stage indices in coordinator and collective messages).
MAX_STAGES = 1024
# Replicas taking part in one collective round; a stage with more is a misconfiguration.
MAX_PARTICIPANTS = 1024
# A hash as text (a run's or a stage's parameters' hex SHA-256 is 64 characters), and a signature
# (an Ed25519 signature is 64 bytes): room for another algorithm, not for a payload.
MAX_HASH = 128
MAX_SIGNATURE = 128
# The memory a node says its stage may use, in GB (0: not said). A claim: it only ever restricts where its
# own node is placed (docs/SECURITY.md), and 1 PB is more than any one device holds.
MAX_MEMORY_GB = 1e6
# Microbatches a node says it lets in at once (its activation memory; 0: not said, the run's batch).
MAX_IN_FLIGHT = 1024

PeerId = Annotated[str, Field(min_length=1, max_length=MAX_PEER_ID)]
Step = Annotated[int, Field(ge=0, lt=2**62)]
StageIndex = Annotated[int, Field(ge=0, lt=MAX_STAGES)]
# A microbatch's index within its step (its ticket).
Ticket = Annotated[int, Field(ge=0, lt=2**31)]
Hash = Annotated[str, Field(max_length=MAX_HASH)]
Signature = Annotated[bytes, Field(max_length=MAX_SIGNATURE)]
# The coordinator's per-lease nonce of a ticket (protocol/acks.py; b"": none, a one-stage run's).
NONCE_BYTES = 16
Nonce = Annotated[bytes, Field(max_length=NONCE_BYTES)]
MemoryGB = Annotated[float, Field(ge=0.0, le=MAX_MEMORY_GB, allow_inf_nan=False)]
InFlight = Annotated[int, Field(ge=0, le=MAX_IN_FLIGHT)]
# A node process's random session id (hex; "": not said): it tells a node's own retry or restart from a
# second process with its key (coordinator/core/admission.py).
Session = Annotated[str, Field(max_length=32, pattern="^[0-9a-f]*$")]

__all__ = [
    "MAX_HASH", "MAX_IN_FLIGHT", "MAX_MEMORY_GB", "MAX_PARTICIPANTS", "MAX_PEER_ID", "MAX_SIGNATURE", "MAX_STAGES", "NONCE_BYTES", "Hash", "InFlight",
    "MemoryGB", "Nonce", "PeerId", "Session", "Signature", "StageIndex", "Step", "Ticket",
]
