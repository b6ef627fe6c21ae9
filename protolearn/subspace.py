"""The fixed subspace of a run's residual stream: the basis U and the fixed token embedding E_fixed.

Protocol Models / Subspace Networks (arXiv 2506.01260; DESIGN.md "Compression"). When the run config's
``[subspace]`` section sets a ``rank`` k, every weight that writes to the residual stream (the token
embedding's trainable part, each attention output projection and MLP down projection) is kept in the
span of one orthonormal basis U (D, k). A boundary activation is then exactly

    h = E_fixed[tok] + U c,        c = Uᵀ (h - E_fixed[tok]) = Uᵀ h

where E_fixed (V, D) is a fixed token embedding orthogonal to U (so Uᵀ E_fixed = 0). Only c (k numbers
per token) and the token ids cross a stage boundary. The stage modules (``stages/``) use this module to
build and constrain the model; the ``subspace`` codec (``protocol/codecs/subspace.py``) and the coordinator's
evidence checks use it to rebuild h. Both are derived here from the run seed alone, so every process
agrees on them bit for bit without a transfer.

Why this module sits in the root package: ``stages`` and ``protocol`` both need it and may not import
each other (see :mod:`protolearn.codec_spec`). It needs torch only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["Subspace", "make_subspace", "subspace_seed"]


def subspace_seed(seed: int, what: str) -> int:
    """The generator seed of one part of the subspace (``basis`` or ``fixed-embedding``) of run ``seed``."""
    digest = hashlib.sha256(f"protolearn-subspace/{seed}/{what}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True, eq=False)
class Subspace:
    """U (D, k) with orthonormal columns and E_fixed (V, D) with Uᵀ E_fixedᵀ = 0, both float32 on the CPU.

    Treat both tensors as read-only: they are cached and shared by every user in the process.
    """

    basis: torch.Tensor  # U, (D, k)
    fixed_embedding: torch.Tensor  # E_fixed, (V, D)

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    @property
    def d_model(self) -> int:
        return self.basis.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.fixed_embedding.shape[0]


@lru_cache(maxsize=8)
def make_subspace(seed: int, vocab_size: int, d_model: int, rank: int, init_std: float) -> Subspace:
    """The subspace of a run: a function of these five numbers only, identical on every device.

    U is the Q factor of a seeded Gaussian (D, k), computed in float64 then rounded; E_fixed is a
    seeded N(0, init_std) token embedding with its component in span(U) removed, so it carries token
    identity in the directions the trainable weights can never write to.
    """
    if not 1 <= rank < d_model:
        raise ValueError(f"subspace rank {rank} must be in [1, d_model={d_model})")
    g = torch.Generator(device="cpu").manual_seed(subspace_seed(seed, "basis"))
    gauss = torch.empty(d_model, rank, dtype=torch.float64).normal_(generator=g)
    q, r = torch.linalg.qr(gauss)  # (D, k), (k, k)
    # Fix the signs (QR is unique only up to them) so the basis does not depend on the LAPACK build.
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(rank, dtype=torch.float64))
    g = torch.Generator(device="cpu").manual_seed(subspace_seed(seed, "fixed-embedding"))
    fixed = torch.empty(vocab_size, d_model, dtype=torch.float64).normal_(0.0, init_std, generator=g)
    fixed = fixed - (fixed @ q) @ q.T  # (V, D), orthogonal to span(U)
    return Subspace(basis=q.float().contiguous(), fixed_embedding=fixed.float().contiguous())
