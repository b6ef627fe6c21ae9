"""How a compressed collective part travels: one self-describing blob, checked before it is decoded.

A part of a compressed round (:mod:`.slice_codec`) travels as the bytes of a ``uint8`` tensor frame
(the collective's raw ``float32`` frames are left as they are). The blob is a one-byte **form**, the
part's length ``L`` (uint32, little-endian), and a body:

=============  =====  =======================================================================
form           tag    body
=============  =====  =======================================================================
``int8``       1      ``ceil(L / 64)`` exponent bytes (``e + 149``, :mod:`.blockfloat`), then L int8
``sparse``     2      ``n`` uint32 indices, strictly increasing and below L, then n float32 values
``dense``      3      L float32 values
=============  =====  =======================================================================

Every form decodes to exactly ``L`` float32 values, and each encoding here is lossless on the values it
is given (``int8`` only accepts values :func:`.blockfloat.project` leaves unchanged), so a part's
receivers decode the very values its sender hashed and signed. :func:`decode` is the one place a
peer's blob is read: it checks the form, the length against what the receiver expects (or its bound),
the byte count against the form, exponents in range, indices in range and increasing, and values
finite, all before it builds a tensor, and refuses with a :class:`~protolearn.protocol.errors.ProtocolError`
naming the peer.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.sync_compression import blockfloat

INT8, SPARSE, DENSE = 1, 2, 3
FORMS = {INT8: "int8", SPARSE: "sparse", DENSE: "dense"}
_HEAD = struct.Struct("<BI")
HEAD_BYTES = _HEAD.size
MAX_LENGTH = (1 << 32) - 1


def max_bytes(length: int) -> int:
    """The largest blob of a part of ``length`` values (a sparse one naming every index)."""
    return HEAD_BYTES + 8 * length


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def encode_int8(x: torch.Tensor) -> bytes:
    """``x`` (L,) float32, already int8-block values (ValueError otherwise), as an ``int8`` blob."""
    return encode_int8_blocks(x.numel(), *blockfloat.exact_quantize(x))


def encode_int8_blocks(length: int, e: torch.Tensor, q: torch.Tensor) -> bytes:
    """An ``int8`` blob of ``length`` values from their block exponents ``e`` and int8 values ``q``."""
    return _HEAD.pack(INT8, length) + _raw((e + blockfloat.E_BIAS).to(torch.uint8)) + _raw(q)


def encode_sparse(x: torch.Tensor) -> bytes:
    """``x`` (L,) float32 as a ``sparse`` blob of its nonzero entries, or ``dense`` when that is smaller."""
    (idx,) = torch.where(x != 0)
    if 8 * idx.numel() >= 4 * x.numel():
        return _HEAD.pack(DENSE, x.numel()) + _raw(x.to(torch.float32))
    return _HEAD.pack(SPARSE, x.numel()) + idx.numpy().astype("<u4").tobytes() + _raw(x[idx])


def _finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all()) if values.size else True


def decode(blob: bytes | bytearray | memoryview, *, peer: str, length: int | None, max_length: int) -> torch.Tensor:
    """The float32 values (L,) of ``peer``'s blob; ``length``: the part's length if the receiver knows it,
    else ``max_length`` bounds it. Raises ProtocolError naming ``peer`` and what is wrong."""
    view = memoryview(blob).cast("B")
    if len(view) < HEAD_BYTES:
        raise ProtocolError(peer, f"compressed part of {len(view)} bytes is shorter than its {HEAD_BYTES}-byte head")
    form, n = _HEAD.unpack_from(view, 0)
    if form not in FORMS:
        raise ProtocolError(peer, f"compressed part has unknown form {form}; expected one of {sorted(FORMS)}")
    if length is not None and n != length:
        raise ProtocolError(peer, f"compressed part says {n} values, the part has {length}")
    if n > max_length:
        raise ProtocolError(peer, f"compressed part of {n} values exceeds the bound of {max_length}")
    body = view[HEAD_BYTES:]
    if form == INT8:
        nb = blockfloat.num_blocks(n)
        if len(body) != nb + n:
            raise ProtocolError(peer, f"int8 part of {n} values must be {nb + n} bytes after its head, got {len(body)}")
        exps = np.frombuffer(body[:nb], dtype=np.uint8)
        if exps.size and int(exps.max()) > blockfloat.E_MAX + blockfloat.E_BIAS:
            raise ProtocolError(peer, f"int8 part has a block exponent above {blockfloat.E_MAX}")
        q = np.frombuffer(body[nb:], dtype=np.int8)
        if q.size and int(q.min()) < -127:
            raise ProtocolError(peer, "int8 part holds -128, which no encoder writes")
        e = torch.from_numpy(exps.astype(np.int64)) - blockfloat.E_BIAS
        return blockfloat.dequantize(e, torch.from_numpy(q.copy()))
    if form == DENSE:
        if len(body) != 4 * n:
            raise ProtocolError(peer, f"dense part of {n} values must be {4 * n} bytes after its head, got {len(body)}")
        values = np.frombuffer(body, dtype="<f4")
        if not _finite(values):
            raise ProtocolError(peer, "dense part holds NaN or Inf")
        return torch.from_numpy(values.astype(np.float32))
    if len(body) % 8 or len(body) // 8 > n:
        raise ProtocolError(peer, f"sparse part of {n} values has a body of {len(body)} bytes; it must be 8 per entry, at most {n} entries")
    k = len(body) // 8
    idx = np.frombuffer(body[: 4 * k], dtype="<u4").astype(np.int64)
    values = np.frombuffer(body[4 * k :], dtype="<f4")
    if k and (int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all())):
        raise ProtocolError(peer, f"sparse part's indices must be strictly increasing and below {n}")
    if not _finite(values):
        raise ProtocolError(peer, "sparse part holds NaN or Inf")
    out = torch.zeros(n, dtype=torch.float32)
    out[torch.from_numpy(idx)] = torch.from_numpy(values.astype(np.float32))
    return out
