"""A node's identity: an Ed25519 key on disk, its libp2p peer ID, and signatures a third party can check.

The key is a 32-byte raw Ed25519 seed in ``<data dir>/identity.key``, created with mode 0600 on first
run and reused afterwards, so a node keeps its peer ID across restarts. The peer ID is computed here
exactly as libp2p does for Ed25519 keys: the protobuf ``PublicKey{Type: Ed25519, Data: <32 bytes>}``
is short enough to be inlined in an *identity* multihash, which is then written in base58btc with the
``base58`` package (``12D3KooW…``). Because the key is inside the ID, anyone holding a peer ID can
verify that peer's signatures (:func:`verify_peer`), which is what makes signed messages usable as
evidence.

Why the derivation (two constant byte prefixes) is written here rather than taken from
``libp2p.peer.id.ID.from_pubkey``: this module is pure, and importing ``libp2p.peer.id`` loads libp2p
and trio with it (measured on py-libp2p 0.8: about 1,200 modules and 0.7-2 s in a fresh interpreter,
against 9 modules and under 25 ms for ``base58``), so ``tests/integration/test_purity.py`` would fail and
every pure user of identities would pay for the whole network stack. ``tests/unit/test_identity.py``
checks the result against libp2p's own ``ID.from_pubkey`` for many keys.

Signatures are plain Ed25519 over the bytes given (Ed25519 hashes internally with SHA-512), the same
as libp2p's own ``PrivateKey.sign``. To sign a message, sign its canonical encoding
(:func:`protolearn.protocol.wire.encode`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protolearn.errors import ProtolearnError
from protolearn.protocol.errors import ProtocolError, SignatureError

KEY_FILE = "identity.key"
KEY_BYTES = 32
SIGNATURE_BYTES = 64
# protobuf PublicKey{Type(field 1, varint) = Ed25519 (1), Data(field 2, bytes) = 32 bytes}
_PROTO_KEY_PREFIX = bytes([0x08, 0x01, 0x12, KEY_BYTES])
# identity multihash (code 0x00) of the 36-byte protobuf key
_MULTIHASH_PREFIX = bytes([0x00, len(_PROTO_KEY_PREFIX) + KEY_BYTES])
_PEER_ID_BYTES = len(_MULTIHASH_PREFIX) + len(_PROTO_KEY_PREFIX) + KEY_BYTES
# An Ed25519 peer ID is 52 characters; anything much longer is refused before big-integer decoding.
_MAX_PEER_ID_CHARS = 64
_RAW = serialization.Encoding.Raw


class IdentityError(ProtolearnError):
    """The identity key file is missing, malformed or unsafe. The message says how to fix it."""


def peer_id_from_public_key(public_bytes: bytes) -> str:
    """Return the libp2p peer ID (``12D3KooW…``) of a raw 32-byte Ed25519 public key."""
    if len(public_bytes) != KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {KEY_BYTES} bytes, got {len(public_bytes)}")
    return base58.b58encode(_MULTIHASH_PREFIX + _PROTO_KEY_PREFIX + public_bytes).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Return the raw Ed25519 public key embedded in ``peer_id``.

    Raises :class:`ProtocolError` naming the peer ID when it is not an inlined Ed25519 key (for
    example an RSA peer ID, which carries only a hash of its key).
    """
    shown = peer_id[:_MAX_PEER_ID_CHARS]
    if len(peer_id) > _MAX_PEER_ID_CHARS:
        raise ProtocolError(shown, f"peer ID of {len(peer_id)} characters is too long for an Ed25519 peer ID")
    try:
        raw = base58.b58decode(peer_id)  # ValueError (UnicodeEncodeError for non-ASCII) on a bad character
    except ValueError as err:
        raise ProtocolError(shown, f"peer ID is not base58: {err}") from None
    prefix = _MULTIHASH_PREFIX + _PROTO_KEY_PREFIX
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(prefix):
        raise ProtocolError(shown, "peer ID does not embed an Ed25519 public key")
    # b58decode ignores trailing whitespace; one key must have exactly one peer ID string, or a
    # signature would verify under two spellings of the same peer.
    if base58.b58encode(raw).decode("ascii") != peer_id:
        raise ProtocolError(shown, "peer ID is not in canonical base58")
    return raw[len(prefix):]


def verify(public_bytes: bytes, data: bytes, signature: bytes, *, peer: str | None = None) -> None:
    """Check that ``signature`` is ``public_bytes``' Ed25519 signature of ``data``.

    Raises :class:`SignatureError` naming ``peer`` (default: the key's peer ID) on any failure,
    including a malformed key or signature.
    """
    if peer is None:
        peer = peer_id_from_public_key(public_bytes) if len(public_bytes) == KEY_BYTES else "unknown"
    if len(public_bytes) != KEY_BYTES:
        raise SignatureError(peer, f"public key is {len(public_bytes)} bytes, Ed25519 needs {KEY_BYTES}")
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureError(peer, f"signature is {len(signature)} bytes, Ed25519 needs {SIGNATURE_BYTES}")
    try:
        Ed25519PublicKey.from_public_bytes(public_bytes).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise SignatureError(peer, "signature does not verify") from None


def verify_peer(peer_id: str, data: bytes, signature: bytes) -> None:
    """Check a signature from the peer ID alone (Ed25519 peer IDs embed their key)."""
    try:
        public_bytes = public_key_from_peer_id(peer_id)
    except ProtocolError as err:
        raise SignatureError(err.peer, err.reason) from None
    verify(public_bytes, data, signature, peer=peer_id)


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair with its libp2p peer ID. ``repr`` never shows the private key."""

    _key: Ed25519PrivateKey = field(repr=False)
    public_bytes: bytes = field(init=False, repr=False)
    peer_id: str = field(init=False)

    def __post_init__(self) -> None:
        public = self._key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
        object.__setattr__(self, "public_bytes", public)
        object.__setattr__(self, "peer_id", peer_id_from_public_key(public))

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, seed: bytes) -> Identity:
        """Rebuild an identity from its 32-byte raw seed (what :attr:`private_bytes` returns)."""
        if len(seed) != KEY_BYTES:
            raise ValueError(f"an Ed25519 private key is {KEY_BYTES} bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def private_bytes(self) -> bytes:
        """The 32-byte raw seed; the libp2p adapter builds its KeyPair from it."""
        return self._key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    def sign(self, data: bytes) -> bytes:
        """Return the 64-byte Ed25519 signature of ``data`` itself (not of a digest of it)."""
        return self._key.sign(data)


def default_data_dir(name: str) -> Path:
    """Where a node or coordinator called ``name`` keeps its key and state: ``~/.protolearn/<name>/``."""
    return Path.home() / ".protolearn" / name


def load_or_create_identity(data_dir: Path) -> Identity:
    """Load ``data_dir/identity.key``, or create it (mode 0600, directory 0700) on first run."""
    path = Path(data_dir) / KEY_FILE
    try:
        Path(data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            _create_key_file(path)
        return _read_key_file(path)
    except OSError as err:
        raise IdentityError(f"cannot use identity key {path}: {err.strerror or err}; check the directory's permissions") from None


def _create_key_file(path: Path) -> None:
    seed = Identity.generate().private_bytes
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(seed)
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() never replaces: when two processes start together, the first key wins and both use it.
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _read_key_file(path: Path) -> Identity:
    mode = path.stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"identity key {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
        )
    with open(path, "rb") as f:
        seed = f.read(KEY_BYTES + 1)
    if len(seed) != KEY_BYTES:
        raise IdentityError(
            f"identity key {path} is not a {KEY_BYTES}-byte Ed25519 key (read {len(seed)}{'+' if len(seed) > KEY_BYTES else ''}"
            " bytes); restore it from a backup, or delete it to start with a new peer ID"
        )
    return Identity.from_private_bytes(seed)
