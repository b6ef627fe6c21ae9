"""Node identity: the peer ID matches libp2p's, signatures verify from a peer ID alone, and the key file
is created private, reused on restart, and refused with one clear line when it is unsafe or damaged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pPublicKey
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from protolearn.errors import ProtolearnError
from protolearn.protocol.errors import ProtocolError, SignatureError
from protolearn.protocol.identity import (
    KEY_FILE,
    Identity,
    IdentityError,
    default_data_dir,
    load_or_create_identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
    verify_peer,
)

posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


@settings(max_examples=50, deadline=None)
@given(seed=st.binary(min_size=32, max_size=32))
def test_peer_id_and_key_pair_match_libp2p(seed: bytes) -> None:
    ident = Identity.from_private_bytes(seed)
    assert ident.private_bytes == seed and len(ident.public_bytes) == 32
    # The libp2p adapter builds its KeyPair from private_bytes: it must land on the same peer ID.
    pair = create_new_key_pair(ident.private_bytes)
    assert pair.public_key.to_bytes() == ident.public_bytes
    assert ident.peer_id == ID.from_pubkey(pair.public_key).to_base58()
    assert ident.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(ident.peer_id) == ident.public_bytes
    # Signatures interoperate both ways.
    assert Libp2pPublicKey.from_bytes(ident.public_bytes).verify(b"evidence", ident.sign(b"evidence"))
    verify(ident.public_bytes, b"by libp2p", pair.private_key.sign(b"by libp2p"))


def test_a_third_party_verifies_a_signature_from_the_peer_id_alone() -> None:
    ident = Identity.generate()
    data = b"activation digest of ticket (7, 3)"
    sig = ident.sign(data)
    assert len(sig) == 64
    verify_peer(ident.peer_id, data, sig)
    verify(ident.public_bytes, data, sig)
    other = Identity.generate()
    cases = [
        (lambda: verify_peer(ident.peer_id, data + b"!", sig), ident.peer_id, "does not verify"),
        (lambda: verify_peer(other.peer_id, data, sig), other.peer_id, "does not verify"),
        (lambda: verify(ident.public_bytes, data, sig[:-1] + bytes([sig[-1] ^ 1])), ident.peer_id, "does not verify"),
        (lambda: verify(ident.public_bytes, data, sig[:63]), ident.peer_id, "signature is 63 bytes"),
        (lambda: verify(ident.public_bytes[:31], data, sig), "unknown", "public key is 31 bytes"),
        (lambda: verify(ident.public_bytes, data, b"", peer="P"), "P", "signature is 0 bytes"),
    ]
    for call, peer, words in cases:
        with pytest.raises(SignatureError) as info:
            call()
        assert info.value.peer == peer and words in info.value.reason


@pytest.mark.parametrize(
    ("peer_id", "words"),
    [
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "does not embed an Ed25519"),  # an RSA-style sha256 peer ID
        ("12D3KooW0OIl", "not base58"),
        ("12D3KooWé", "not base58"),
        ("", "does not embed"),
        ("1" * 500, "too long"),
        ("12D3KooWEvi1Peer", "does not embed"),  # base58, but far too short
    ],
)
def test_peer_ids_without_an_ed25519_key_are_refused(peer_id: str, words: str) -> None:
    with pytest.raises(ProtocolError) as info:
        public_key_from_peer_id(peer_id)
    assert words in info.value.reason and len(info.value.peer) <= 64
    with pytest.raises(SignatureError):
        verify_peer(peer_id, b"x", bytes(64))


@pytest.mark.parametrize("suffix", [" ", "\n", "\t ", "\x00"])
def test_a_peer_id_has_one_spelling(suffix: str) -> None:
    # base58.b58decode strips trailing whitespace; a second spelling of a peer ID must not verify.
    ident = Identity.generate()
    sig = ident.sign(b"x")
    verify_peer(ident.peer_id, b"x", sig)
    with pytest.raises(ProtocolError) as info:
        public_key_from_peer_id(ident.peer_id + suffix)
    assert "base58" in info.value.reason
    with pytest.raises(SignatureError):
        verify_peer(ident.peer_id + suffix, b"x", sig)


def test_repr_never_shows_the_private_key() -> None:
    ident = Identity.generate()
    text = repr(ident)
    assert ident.peer_id in text and ident.private_bytes.hex() not in text and "_key" not in text


def test_peer_id_needs_a_32_byte_key() -> None:
    with pytest.raises(ValueError):
        peer_id_from_public_key(bytes(31))
    with pytest.raises(ValueError):
        Identity.from_private_bytes(bytes(33))


@posix_only
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_key_readable_by_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    ident = load_or_create_identity(tmp_path)
    key = tmp_path / KEY_FILE
    key.chmod(mode)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and f"chmod 600 {key}" in msg and f"{mode:o}" in msg
    assert key.read_bytes() == ident.private_bytes  # refused, never replaced
    key.chmod(0o600)
    assert load_or_create_identity(tmp_path).peer_id == ident.peer_id


@posix_only
@pytest.mark.parametrize("content", [b"", b"garbage", bytes(31), bytes(33), b"-----BEGIN PRIVATE KEY-----\n" + bytes(64)])
def test_a_damaged_key_file_gets_one_clear_line(tmp_path: Path, content: bytes) -> None:
    key = tmp_path / KEY_FILE
    key.write_bytes(content)
    key.chmod(0o600)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(tmp_path)
    msg = str(info.value)
    assert isinstance(info.value, ProtolearnError)
    assert "\n" not in msg and str(key) in msg and "32-byte" in msg and "delete it" in msg
    assert key.read_bytes() == content  # a damaged key is never silently replaced: that would change the peer ID


@posix_only
def test_an_unusable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(blocker / "node")
    assert "\n" not in str(info.value) and str(blocker / "node" / KEY_FILE) in str(info.value)


def test_default_data_dir_is_under_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir("alice") == tmp_path / ".protolearn" / "alice"
