"""int8 with one power-of-two scale per block of :data:`BLOCK` values: the ``int8`` sync compression.

A part of ``L`` float32 values is cut into blocks of :data:`BLOCK` (the last one shorter), counted from
the part's first value. Block ``b`` keeps ``q = round(x / 2**e_b)`` with ``q`` an int8 in [-127, 127] and
``e_b`` the **smallest** exponent for which the block's largest magnitude rounds to at most 127 (a shared
exponent, as the OCP microscaling formats use). :func:`project` is the values this keeps, ``q * 2**e_b``.

Why powers of two rather than ``absmax / 127`` (as the boundary ``int8`` codec uses): every step here is
exact, so the result is the same bits on every machine and :func:`project` is idempotent.

* ``x / 2**e`` is exact in float64, rounding is half-to-even, and ``q * 2**e`` is exact in float32 for
  every ``e`` in [:data:`E_MIN`, :data:`E_MAX`] (a 7-bit integer times a power of two that is itself a
  float32, subnormals included).
* Idempotent: a projected block holds multiples of ``2**e`` of magnitude at most ``127 * 2**e``, so ``e``
  fits it and its smallest fitting exponent ``e'`` is at most ``e``; its values divided by ``2**e'`` are
  then integers of magnitude at most 127, and projecting again changes no bit. This is what lets the
  collective carry a projected part in this encoding losslessly (:mod:`.wire`), and lets a reducer's
  projection of its reduced part be recomputed bit for bit by a checker.

Error: every value is within ``2**(e_b - 1)`` of the input, and ``2**e_b <= max|block| / 63.75``, so
about 0.8% of the block's largest magnitude at worst (an absmax scale would give 0.4%). A block whose
largest magnitude is ``127.5 * 2**E_MAX`` or more (about 2.6e33) cannot be encoded: :func:`exponents`
raises ValueError (a gradient that large has diverged).
"""

from __future__ import annotations

import torch

BLOCK = 64
# Exponents a block may have: q * 2**e is an exact float32 for |q| <= 127 (2**-149 is the least subnormal).
E_MIN = -149
E_MAX = 104
# On the wire an exponent is one byte, e - E_MIN.
E_BIAS = -E_MIN


def num_blocks(length: int) -> int:
    return (length + BLOCK - 1) // BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (L,) as (num_blocks, BLOCK), zero-padded."""
    n = num_blocks(x.numel())
    pad = n * BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).reshape(n, BLOCK) if pad else x.reshape(n, BLOCK)


def exponents(x: torch.Tensor) -> torch.Tensor:
    """The smallest fitting exponent of each block of ``x`` (L,) float32, as int64 (num_blocks,).

    With ``amax = m * 2**E`` (``m`` in [0.5, 1)): ``amax / 2**(E-7) = 128 m`` fits (< 127.5) unless
    ``m >= 127.5 / 128``, when ``E - 6`` does; one less never fits. ``128 m`` is exact.
    """
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("int8 blocks cannot hold NaN or Inf")
    amax = _blocks(x).abs().amax(dim=1) if x.numel() else x.new_zeros(0)  # (num_blocks,)
    m, e = torch.frexp(amax)
    e = e.long() - 7 + (m * 128 >= 127.5).long()
    if e.numel() and int(e.max()) > E_MAX:
        raise ValueError(f"a block's magnitude {float(amax.max()):.3g} is too large for int8 blocks")
    return torch.where(amax > 0, e, E_MIN).clamp(min=E_MIN)  # an all-zero block: the least exponent


def _scales(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Powers of two in [2**-149, 2**104]: exact in float64 and in float32.
    return torch.pow(2.0, e.to(torch.float64)).to(dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (L,) float32 as (exponents (num_blocks,) int64, q (L,) int8)."""
    e = exponents(x)
    scaled = _blocks(x.double()) / _scales(e, torch.float64)[:, None]  # exact: division by a power of two
    q = torch.round(scaled).reshape(-1)[: x.numel()]
    return e, q.to(torch.int8)


def dequantize(e: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The float32 values (L,) of exponents ``e`` and int8 ``q`` (L,): exact products."""
    n = q.numel()
    scales = _scales(e, torch.float32)
    return (_blocks(q.to(torch.float32)) * scales[:, None]).reshape(-1)[:n]


def project(x: torch.Tensor) -> torch.Tensor:
    """What int8 blocks keep of ``x`` (L,) float32: ``dequantize(quantize(x))``, idempotent."""
    return dequantize(*quantize(x))


def exact_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of an ``x`` that :func:`project` leaves unchanged; ValueError for any other
    (encoding it would lose bits, so a caller passed a contribution it did not project)."""
    e, q = quantize(x)
    if not torch.equal(dequantize(e, q), x):
        raise ValueError("this part is not int8-block values: project it before encoding it")
    return e, q
