"""The bulk lane's wire format: AES-256-GCM sealed chunks on a plain TCP socket, and the dial.

Blocking code with no trio: :mod:`protolearn.protocol.transport.bulk` runs it in worker threads.

A payload of ``total`` bytes travels as ``ceil(total / CHUNK_BYTES)`` chunks (one, tag only, when it
is empty). Chunk ``i`` is the ciphertext of plaintext bytes ``[i * CHUNK_BYTES, ...)`` followed by its
16-byte tag, with nonce ``i`` and associated data (total, i, last): the key is fresh per transfer, so
the nonce never repeats, and a chunk that is reordered, replayed, cut, or taken from another transfer
fails authentication. No lengths travel: both sides derive every chunk's size from the validated
``total``. The dialler presents the 16-byte token first, and the lane answers with
``HMAC-SHA256(key, "protolearn-bulk-ok" + token)[:16]`` before any payload byte moves.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import socket
import struct
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError
from protolearn.protocol.transport.clock import MONOTONIC, Clock

CHUNK_BYTES = 1024 * 1024
TAG_BYTES = 16
TOKEN_BYTES = 16
CONFIRM_BYTES = 16
KEY_BYTES = 32
_AAD = struct.Struct(">QQ?")  # total bytes, chunk index, last chunk


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "big")


def _chunks(total: int) -> int:
    return max(1, -(-total // CHUNK_BYTES))


def seal_chunks(key: bytes, data: memoryview) -> Iterator[memoryview]:
    """Yield ``data`` sealed chunk by chunk (each view is valid until the next one is made)."""
    aead = AESGCM(key)
    total = len(data)
    n = _chunks(total)
    view = memoryview(bytearray(min(CHUNK_BYTES, total) + TAG_BYTES))
    for i in range(n):
        a = i * CHUNK_BYTES
        b = min(total, a + CHUNK_BYTES)
        sealed = view[: b - a + TAG_BYTES]
        aead.encrypt_into(_nonce(i), data[a:b], _AAD.pack(total, i, i == n - 1), sealed)
        yield sealed


def send_chunks(
    sock: socket.socket, key: bytes, data: memoryview, *, peer: str, chunk_timeout: float, total_timeout: float = math.inf,
    clock: Clock = MONOTONIC,
) -> None:
    """Seal and send ``data`` chunk by chunk; each chunk must be taken within ``chunk_timeout``, and all
    of them within ``total_timeout`` (a receiver that reads a trickle must not hold this thread for ever)."""
    n = _chunks(len(data))
    end = clock() + total_timeout
    for i, sealed in enumerate(seal_chunks(key, data)):
        left = min(chunk_timeout, end - clock())
        if left <= 0:
            raise PeerTimeout(peer, f"bulk transfer of {len(data)} bytes not taken within {total_timeout:g} s (chunk {i} of {n})")
        sock.settimeout(left)  # sendall's timeout bounds the whole chunk
        try:
            sock.sendall(sealed)
        except TimeoutError:
            raise PeerTimeout(peer, f"bulk chunk {i} of {n} not taken within {left:g} s") from None
        except OSError as err:
            raise PeerUnavailable(peer, f"bulk lane broke ({type(err).__name__}) in chunk {i} of {n}") from None


def receive_chunks(
    sock: socket.socket, key: bytes, out: bytearray, *, peer: str, chunk_timeout: float, clock: Clock = MONOTONIC,
    total_timeout: float = math.inf,
) -> None:
    """Fill ``out`` (exactly the validated size) with the opened chunks; each chunk within ``chunk_timeout``
    and the whole transfer within ``total_timeout`` (so a trickle cannot hold the thread for ever).

    ``clock`` measures the chunk deadline; it runs in this (worker) thread, see
    :mod:`protolearn.protocol.transport.clock`.
    """
    aead = AESGCM(key)
    total = len(out)
    n = _chunks(total)
    scratch = bytearray(min(CHUNK_BYTES, total) + TAG_BYTES)
    sv, ov = memoryview(scratch), memoryview(out)
    end = clock() + total_timeout
    for i in range(n):
        a = i * CHUNK_BYTES
        b = min(total, a + CHUNK_BYTES)
        want = b - a + TAG_BYTES
        got = 0
        # A per-chunk deadline, not per recv: a peer trickling bytes must still deliver a chunk in time.
        deadline = min(clock() + chunk_timeout, end)
        while got < want:
            left = deadline - clock()
            if left <= 0:
                raise PeerTimeout(peer, _late(i, n, a + got, total, chunk_timeout, total_timeout, whole=deadline == end))
            sock.settimeout(left)
            try:
                k = sock.recv_into(sv[got:want])
            except TimeoutError:
                raise PeerTimeout(peer, _late(i, n, a + got, total, chunk_timeout, total_timeout, whole=deadline == end)) from None
            except OSError as err:
                raise PeerUnavailable(peer, f"bulk lane broke ({type(err).__name__}) after {a + got} of {total} bytes") from None
            if not k:
                raise PeerUnavailable(peer, f"bulk lane ended mid-tensor in chunk {i} of {n} ({a} of {total} bytes done)")
            got += k
        try:
            aead.decrypt_into(_nonce(i), sv[:want], _AAD.pack(total, i, i == n - 1), ov[a:b])
        except InvalidTag:
            raise ProtocolError(peer, f"bulk chunk {i} of {n} failed authentication (tampered or misordered)") from None


def _late(i: int, n: int, done: int, total: int, chunk_timeout: float, total_timeout: float, *, whole: bool) -> str:
    if whole:
        return f"bulk transfer of {total} bytes not complete within {total_timeout:g} s ({done} bytes came; too slow)"
    return f"bulk chunk {i} of {n} not complete within {chunk_timeout:g} s"


def confirmation(key: bytes, token: bytes) -> bytes:
    """What the lane answers a valid token with: proof it is the receiver that made the offer."""
    return hmac.new(key, b"protolearn-bulk-ok" + token, hashlib.sha256).digest()[:CONFIRM_BYTES]


def dial(ip: str, port: int, token: bytes, key: bytes, timeout: float) -> socket.socket:
    """Connect to a lane, present ``token`` and check its confirmation; OSError (timeouts too) if not.

    The check matters behind NAT or a relay: the IP of the libp2p connection may be some other
    machine, where some other service may accept the connection; without a confirmation the payload
    would go there and the receiver would wait out its deadline instead of getting a fallback.
    """
    sock = socket.create_connection((ip, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
        got = b""
        while len(got) < CONFIRM_BYTES:
            piece = sock.recv(CONFIRM_BYTES - len(got))
            if not piece:
                raise ConnectionError(f"the lane closed the connection after {len(got)} of {CONFIRM_BYTES} confirmation bytes")
            got += piece
        if not hmac.compare_digest(got, confirmation(key, token)):
            raise ConnectionError("the lane's confirmation does not match the offer (not the peer that made it)")
    except OSError:
        sock.close()
        raise
    return sock
