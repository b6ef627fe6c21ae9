"""Message schemas and the msgpack envelope that carries them.

Every message kind is a frozen pydantic model that subclasses :class:`Message` and sets a unique
``KIND``. On the wire a message is one msgpack map ``{"v": version, "k": kind, "b": body}``, and
on a stream each encoded message is preceded by an 8-byte big-endian length prefix, so a peer that
dies mid-message is told apart from one that finished (libp2p reports both as EOF).

Decoding trusts nothing: the length is checked against a limit before anything is allocated,
msgpack's own limits are bounded by the buffer size, the version must be known, the kind must be
one the caller expects, and the body is validated strictly (no type coercion). Failures raise
:class:`~protolearn.protocol.errors.ProtocolError` naming the peer and the reason.

Schema rule: sequences in messages are ``list[...]`` (msgpack decodes arrays as lists, and strict
validation refuses lists for tuple fields); binary payloads are ``bytes``.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any, ClassVar, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError

from protolearn.protocol.errors import ProtocolError, TooLarge

# The version of this envelope's format (its "v"), not of the libp2p protocol IDs (the transport's
# PROTOCOL_ID_VERSION in /protolearn/<name>/1.0.0).
WIRE_VERSION = 1
SUPPORTED_VERSIONS = frozenset({WIRE_VERSION})
LENGTH_PREFIX = struct.Struct(">Q")
# Default upper bound for one message. Large tensors are streamed in chunks below this size.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long a request waits for its reply unless the caller says otherwise: the transport's
# TransportConfig.request_timeout_s and a node's --request-timeout default to it.
DEFAULT_REQUEST_TIMEOUT_S = 30.0

M = TypeVar("M", bound="Message")


class Message(BaseModel):
    """Base of every message kind. Subclasses set ``KIND`` and are registered by it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    KIND: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[Message]]] = {}
    # List fields of records that are sent over and over, the same objects each time (the coordinator's view
    # entries): encode dumps each record once, while it lives (:func:`dumped`), not once per message.
    REPEATED_RECORDS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND", "")
        if kind:
            other = Message.registry.get(kind)
            if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
                raise TypeError(f"message kind {kind!r} is used by both {other.__qualname__} and {cls.__qualname__}")
            Message.registry[kind] = cls


class Record(BaseModel):
    """A record nested inside a message: as strict and frozen as a message, but with no kind of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ErrorReply(Message):
    """A typed refusal sent back instead of a normal reply."""

    KIND: ClassVar[str] = "error"
    code: str
    reason: str


# Each record's dump, by the record's identity, for as long as the record lives (frozen: it never changes).
_DUMPS: dict[int, dict[str, Any]] = {}


def dumped(rec: Record) -> dict[str, Any]:
    """``rec.model_dump()``, made once per record object: a coordinator's heartbeat replies carried each joiner
    to every member, and dumping those entries was 9 % of its CPU over a ramp to 3,500 members."""
    key = id(rec)
    body = _DUMPS.get(key)
    if body is None:
        body = _DUMPS[key] = rec.model_dump()
        weakref.finalize(rec, _DUMPS.pop, key, None)  # before the id can name another object
    return body


def encode(msg: Message) -> bytes:
    """Return the msgpack envelope of ``msg`` (without the length prefix)."""
    if not msg.KIND:
        raise TypeError(f"{type(msg).__qualname__} has no KIND")
    repeated = msg.REPEATED_RECORDS
    if repeated:
        body = msg.model_dump(exclude=set(repeated))
        for name in repeated:
            body[name] = [dumped(r) for r in getattr(msg, name)]
    else:
        body = msg.model_dump()
    return msgpack.packb({"v": WIRE_VERSION, "k": msg.KIND, "b": body}, use_bin_type=True)


def record_size(rec: Record) -> int:
    """How many bytes ``rec`` takes inside an encoded message (msgpack encodes a nested map as it would alone)."""
    return len(msgpack.packb(dumped(rec), use_bin_type=True))


def encoded_size(msg: Message, items: str, item_bytes: int, num_items: int) -> int:
    """``len(encode(msg))``, with its list field ``items`` counted from its items' sizes (``num_items`` of them,
    ``item_bytes`` in all, e.g. summed :func:`record_size`) instead of encoded again: msgpack writes a list as a
    header and then its items one after another. For a caller that checks a reply's size against a cap and caches
    the sizes of the items it sends over and over (a join reply's view: coordinator/core/view.py)."""
    body = msg.model_dump(exclude={items})
    body[items] = []  # as many keys as the whole message has: the map's header is the same
    empty = len(msgpack.packb({"v": WIRE_VERSION, "k": msg.KIND, "b": body}, use_bin_type=True))
    header = 1 if num_items < 16 else 3 if num_items < 1 << 16 else 5  # fixarray, array 16, array 32
    return empty - 1 + header + item_bytes


def frame(msg: Message, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Return ``msg`` encoded with its length prefix, refusing to build one larger than ``max_bytes``."""
    body = encode(msg)
    if len(body) > max_bytes:
        raise TooLarge("local", f"{msg.KIND} message of {len(body)} bytes exceeds the limit of {max_bytes}")
    return LENGTH_PREFIX.pack(len(body)) + body


def parse_length(prefix: bytes, *, peer: str, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Validate a length prefix before the body is read or allocated."""
    if len(prefix) != LENGTH_PREFIX.size:
        raise ProtocolError(peer, f"truncated length prefix ({len(prefix)} of {LENGTH_PREFIX.size} bytes)")
    (n,) = LENGTH_PREFIX.unpack(prefix)
    if n == 0:
        raise ProtocolError(peer, "empty message")
    if n > max_bytes:
        raise TooLarge(peer, f"declared message length {n} exceeds the limit of {max_bytes}")
    return n


def decode(data: bytes, *, peer: str, expect: type[M] | tuple[type[Message], ...] | None = None) -> Message:
    """Decode one envelope from ``peer``. ``expect`` restricts which kinds are acceptable."""
    try:
        # msgpack >= 1.0 bounds every container and string by len(data), so a small buffer cannot
        # claim a huge allocation.
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as err:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(peer, f"malformed msgpack: {type(err).__name__}") from err
    if not isinstance(obj, dict) or set(obj) != {"v", "k", "b"}:
        raise ProtocolError(peer, "envelope is not a map of exactly v, k, b")
    version, kind, body = obj["v"], obj["k"], obj["b"]
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(peer, f"unsupported protocol version {version!r} (supported: {sorted(SUPPORTED_VERSIONS)})")
    if not isinstance(kind, str):
        raise ProtocolError(peer, "message kind is not a string")
    cls = Message.registry.get(kind)
    if cls is None:
        raise ProtocolError(peer, f"unknown message kind {kind[:64]!r}")
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if cls not in allowed and cls is not ErrorReply:
            names = ", ".join(c.KIND for c in allowed)
            raise ProtocolError(peer, f"unexpected message kind {kind!r} (expected {names})")
    if not isinstance(body, dict):
        raise ProtocolError(peer, f"{kind} body is not a map")
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ProtocolError(peer, f"invalid {kind}: {where}: {first['msg']}") from None
