"""PowerSGD (Vogels et al. 2019): a rank-R average of every matrix gradient, in two exact collective rounds.

Each gradient tensor with 2 or more dimensions is a matrix ``M`` of ``n`` rows (its first dimension) and
``m`` columns (the rest), compressed when ``R (n + m) < n m``; the others (norm gains, small matrices)
travel raw. A replica with warm-start factors ``Q`` (``m x R`` per matrix):

1. forms ``M = G + E`` (its summed gradient plus its error-feedback residual, :mod:`.feedback`) and
   contributes ``P = M Q`` (``n x R``) for each matrix, followed by its raw tensors: round A (phase 0,
   :func:`~protolearn.protocol.rounds.round_id`) sums these exactly, giving ``P_sum``;
2. orthonormalises each ``P_sum`` into ``U`` (:func:`orthonormalize`) and contributes ``Q_i = M^T U``
   (``m x R``): round B (phase 1) sums them, giving ``Q_sum``;
3. applies ``U Q_sum^T = U U^T (sum of M)`` (:func:`decode`), keeps ``E' = M - U Q_i^T`` (what its own
   contribution lost) and warm-starts the next step with ``Q = Q_sum``.

Why every replica applies the same bits (I2): both rounds are the collective's ordinary exact float32
rounds, whose results are bit-identical on every survivor; the update is :func:`decode`, a pure
function of the two results computed with elementwise IEEE operations in a fixed order only (Gram-Schmidt
with dot products summed in a fixed pairwise tree, float64 inside, one rounding to float32), never a
BLAS call whose summation order depends on the machine. A replica the step's accounting left out
fetches both results and decodes them the same way. The local products ``M Q`` and ``M^T U`` are each
replica's own contribution, so their arithmetic may differ from machine to machine.

The warm start ``Q`` is per-replica state, like the residual: every replica that decoded a step (its
participants and the replicas that fetched it) holds the same ``Q_sum`` from then on. A replica that
takes another state (resync, join, restore) starts again from the seeded :func:`initial_q`. Then its
``Q`` differs from the others' for one step, and that cannot split the replicas: ``U`` comes from the
summed ``P`` and ``Q_sum = U^T (sum of M)`` from the summed second round, so the update is the projection
of the true sum onto one common basis ``U`` whatever ``Q`` each replica started from; only that basis
is a little worse for one step. Why not sync ``Q`` with the state: it would be a fourth kind of state
to download and checkpoint, to save one step of a slightly worse basis.

A replica that dies between the rounds is left out of round B like any dead contributor; the step's
accounting then redoes its tickets. The update stays the projection of the survivors' sum onto ``U``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protolearn.protocol.sync_compression.feedback import ErrorFeedback


@dataclass(frozen=True)
class Block:
    """One gradient tensor in the flat vector: where it is, and how it travels."""

    offset: int
    numel: int
    rows: int
    cols: int
    compressed: bool
    p_offset: int  # where its P (or its raw values) sit in round A's vector
    q_offset: int  # where its Q sits in round B's vector (compressed only)


@dataclass(frozen=True)
class Layout:
    """The blocks of a stage's flat gradient, in flat order, and the lengths of the two rounds' vectors."""

    rank: int
    blocks: tuple[Block, ...]
    numel: int
    p_numel: int
    q_numel: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], rank: int) -> Layout:
        if rank < 1:
            raise ValueError(f"powersgd rank must be at least 1, got {rank}")
        blocks, offset, p, q = [], 0, 0, 0
        for shape in shapes:
            numel = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else numel
            cols = numel // rows if len(shape) >= 2 and rows else 1
            compressed = len(shape) >= 2 and rank * (rows + cols) < numel
            blocks.append(Block(offset, numel, rows, cols, compressed, p, q))
            offset += numel
            p += rows * rank if compressed else numel
            q += cols * rank if compressed else 0
        return cls(rank, tuple(blocks), offset, p, q)


def _pairwise_colsum(x: torch.Tensor) -> torch.Tensor:
    """Column sums of ``x`` (n, R) float64 in a fixed pairwise tree: the same bits on any machine."""
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, x.new_zeros(1, x.shape[1])])
        x = x[0::2] + x[1::2]
    return x[0] if x.shape[0] else x.new_zeros(x.shape[1])


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt of the columns of ``p`` (n, R) float32, deterministically (module docstring);
    a column that is (numerically) in the span of the earlier ones becomes zero. Returns (n, R) float32."""
    u = p.to(torch.float64).clone()  # (n, R)
    for k in range(u.shape[1]):
        v = u[:, k].clone()
        for j in range(k):
            v = v - _pairwise_colsum((v * u[:, j])[:, None])[0] * u[:, j]
        norm = math.sqrt(float(_pairwise_colsum((v * v)[:, None])[0]))
        u[:, k] = v / norm if norm > 0.0 else 0.0
    return u.to(torch.float32)


def reconstruct(u: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``u q^T`` for ``u`` (n, R) and ``q`` (m, R) float32: rank-one terms added in order in float64 (each
    product of two float32 is exact there), one rounding to float32. Returns (n, m)."""
    out = torch.zeros(u.shape[0], q.shape[0], dtype=torch.float64)
    for k in range(u.shape[1]):
        out += u[:, k, None].to(torch.float64) * q[None, :, k].to(torch.float64)
    return out.to(torch.float32)


def _p_block(p_sum: torch.Tensor, b: Block, rank: int) -> torch.Tensor:
    return p_sum[b.p_offset : b.p_offset + b.rows * rank].reshape(b.rows, rank)


def _q_block(q_sum: torch.Tensor, b: Block, rank: int) -> torch.Tensor:
    return q_sum[b.q_offset : b.q_offset + b.cols * rank].reshape(b.cols, rank)


def decode(layout: Layout, p_sum: torch.Tensor, q_sum: torch.Tensor) -> torch.Tensor:
    """The update (numel,) float32 from round A's and round B's results: the same bits on every replica."""
    if p_sum.numel() != layout.p_numel or q_sum.numel() != layout.q_numel:
        raise ValueError(f"powersgd results of {p_sum.numel()} and {q_sum.numel()} values; the layout needs {layout.p_numel} and {layout.q_numel}")
    out = torch.empty(layout.numel, dtype=torch.float32)
    r = layout.rank
    for b in layout.blocks:
        if b.compressed:
            u = orthonormalize(_p_block(p_sum, b, r))
            out[b.offset : b.offset + b.numel] = reconstruct(u, _q_block(q_sum, b, r)).reshape(-1)
        else:
            out[b.offset : b.offset + b.numel] = p_sum[b.p_offset : b.p_offset + b.numel]
    return out


def initial_q(layout: Layout, seed: int) -> list[torch.Tensor | None]:
    """The seeded warm start of every compressed block, (cols, R) float32 (None for a raw one)."""
    out: list[torch.Tensor | None] = []
    for k, b in enumerate(layout.blocks):
        if not b.compressed:
            out.append(None)
            continue
        gen = torch.Generator().manual_seed((seed * 1_000_003 + k) % (1 << 63))
        out.append(torch.randn(b.cols, layout.rank, generator=gen))
    return out


class PowerSGD:
    """One replica's side of PowerSGD: its warm start and residual, and the three steps of the module
    docstring. A step's residual and warm start are staged, and committed when the step is applied."""

    def __init__(self, shapes: Sequence[Sequence[int]], rank: int, seed: int) -> None:
        self.layout = Layout.of(shapes, rank)
        self.seed = seed
        self.feedback = ErrorFeedback()
        self.q = initial_q(self.layout, seed)
        self._staged_q: tuple[int, list[torch.Tensor | None]] | None = None
        self._m: torch.Tensor | None = None  # (numel,) this step's M, between rounds A and B

    def first(self, grad: torch.Tensor) -> torch.Tensor:
        """Round A's contribution (p_numel,) for summed gradient ``grad`` (numel,)."""
        lay = self.layout
        if grad.numel() != lay.numel:
            raise ValueError(f"powersgd expects a gradient of {lay.numel} values, got {grad.numel()}")
        m = self._m = self.feedback.corrected(grad.to(torch.float32))
        out = torch.empty(lay.p_numel, dtype=torch.float32)
        for b, q in zip(lay.blocks, self.q):
            block = m[b.offset : b.offset + b.numel]
            if b.compressed:
                assert q is not None
                out[b.p_offset : b.p_offset + b.rows * lay.rank] = (block.reshape(b.rows, b.cols) @ q).reshape(-1)
            else:
                out[b.p_offset : b.p_offset + b.numel] = block
        return out

    def second(self, step: int, p_sum: torch.Tensor) -> torch.Tensor:
        """Round B's contribution (q_numel,) from round A's result; stages this step's residual."""
        lay, m = self.layout, self._m
        if m is None:
            raise RuntimeError("powersgd: second() before first()")
        out = torch.empty(lay.q_numel, dtype=torch.float32)
        residual = torch.zeros_like(m)
        for b in lay.blocks:
            if not b.compressed:
                continue  # sent exactly: nothing left over
            u = orthonormalize(_p_block(p_sum, b, lay.rank))  # (rows, R)
            mat = m[b.offset : b.offset + b.numel].reshape(b.rows, b.cols)
            q_own = mat.T @ u  # (cols, R)
            out[b.q_offset : b.q_offset + b.cols * lay.rank] = q_own.reshape(-1)
            residual[b.offset : b.offset + b.numel] = (mat - u @ q_own.T).reshape(-1)
        self.feedback.stage(step, residual)
        self._m = None
        return out

    def finish(self, step: int, p_sum: torch.Tensor, q_sum: torch.Tensor) -> torch.Tensor:
        """The update from both results (:func:`decode`); stages ``q_sum`` as the next warm start. A replica
        that contributed nothing (or fetched the step) calls only :meth:`begin` and this, and keeps its residual."""
        out = decode(self.layout, p_sum, q_sum)
        self._staged_q = (step, [_q_block(q_sum, b, self.layout.rank).clone() if b.compressed else None for b in self.layout.blocks])
        return out

    def begin(self, step: int) -> None:
        """An attempt at ``step`` starts (its first revision, or a later one after a failed round): forget
        what an earlier attempt staged, so that only the attempt that is applied commits anything."""
        self._m = None
        self.feedback.stage(step, None)
        self._staged_q = None

    def commit(self, step: int) -> None:
        """``step`` was applied: its residual and warm start become this replica's."""
        self.feedback.commit(step)
        staged, self._staged_q = self._staged_q, None
        if staged is not None and staged[0] == step:
            self.q = staged[1]

    def reset(self) -> None:
        """This replica takes another state: zero residual, seeded warm start."""
        self.feedback.reset()
        self.q = initial_q(self.layout, self.seed)
        self._staged_q = None
        self._m = None
