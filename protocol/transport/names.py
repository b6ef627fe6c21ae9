"""The names the transport speaks: libp2p protocol IDs and peer IDs.

A protolearn protocol has a short name, defined once by the module whose messages it carries
(``protocol/pipeline.py``, ``protocol/coordination.py``); on the wire it is the versioned libp2p
protocol ID :func:`protocol_id` makes of it, ``/protolearn/<name>/1.0.0``. :func:`parse_peer_id` turns a
peer ID as text into py-libp2p's :class:`ID`, refusing a malformed one with the error a failed dial
raises (a peer ID usually comes from someone else: an address we were given, a message).
"""

from __future__ import annotations

from libp2p.peer.id import ID

from protolearn.protocol.errors import PeerUnavailable

PROTOCOL_PREFIX = "/protolearn/"
# The version in every protocol ID (/protolearn/<name>/1.0.0), not the message envelope's (wire.WIRE_VERSION).
PROTOCOL_ID_VERSION = "1.0.0"


def protocol_id(name: str) -> str:
    """The versioned libp2p protocol ID of a protolearn protocol name."""
    return f"{PROTOCOL_PREFIX}{name}/{PROTOCOL_ID_VERSION}"


def parse_peer_id(text: str) -> ID:
    try:
        return ID.from_base58(text)
    except Exception as err:  # base58 and multihash raise several unrelated types
        raise PeerUnavailable(text[:80], f"invalid peer ID: {err}") from None


__all__ = ["PROTOCOL_ID_VERSION", "PROTOCOL_PREFIX", "parse_peer_id", "protocol_id"]
