"""Replica sync of one stage: a step's average as the run's ``[sync] compression`` makes it.

:class:`ReplicaSync` sits between the step's finishing (:mod:`protolearn.node.finishing`, which carries
out the node core's ``Average`` and ``Fetch``) and the collective adapter (:mod:`protolearn.node.averaging`).
It holds this replica's compression state (:mod:`protolearn.protocol.sync_compression`: the error-feedback
residual, PowerSGD's warm start) and turns a summed gradient into the round(s) the compression needs:

* ``none``: one round of the raw gradient, exactly as the collective always ran;
* ``int8`` / ``topk:F``: one round of this replica's contribution (gradient plus residual, projected part
  by part over the round's parts), carried in the codec's encoding; the result is the decoded average;
* ``powersgd:R``: round A (phase 0) of the P factors and raw tensors, round B (phase 1) of the Q factors
  among A's survivors, then the deterministic decoding of the two results.

The vector is any flat float32 vector the stage averages with ``op="sum"``: a step's summed gradient, or
(for a DiLoCo outer step) a pseudo-gradient; ``step`` is the step it is applied as, which keys what is
staged and committed. A replica with weight 0 (no ticket) contributes nothing and keeps its residual; a replica the accounting
left out fetches the result(s) and decodes them alike. Every attempt at a step starts afresh from the
committed state (:meth:`begin`), and :meth:`commit` makes a step's residual and warm start this replica's
once the step is applied; :meth:`reset` forgets them when the replica takes another state. What any of
this costs in bytes is the averager's :attr:`~protolearn.node.averaging.Averager.bytes_sent`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import trio
from protolearn.node.averaging import Averager
from protolearn.protocol.collective.ownership import part_bounds
from protolearn.protocol.collective.result_proof import vector_digest
from protolearn.protocol.rounds import phase_round
from protolearn.protocol.sync_compression import PowerSGD, SliceCompressor, slice_codec
from protolearn.sync_spec import SyncCompression


@dataclass(frozen=True)
class Averaged:
    """A step's average as this replica holds it: the update, its result hash, and the dead contributors left out."""

    result: torch.Tensor
    digest: bytes
    excluded: list[str]


class ReplicaSync:
    """This replica's side of its stage's sync under ``compression``; ``shapes``: its gradient tensors in
    flat order (PowerSGD factors the matrices); ``seed``: the run's (PowerSGD's initial warm start)."""

    def __init__(self, averager: Averager, compression: SyncCompression, shapes: Sequence[Sequence[int]], *, seed: int,
                 compute: trio.CapacityLimiter | None = None) -> None:
        self.averager = averager
        self.compression = compression
        self.codec = slice_codec(compression)
        self._slices = SliceCompressor(self.codec) if self.codec is not None else None
        self._power = PowerSGD(shapes, compression.rank, seed) if compression.name == "powersgd" and compression.rank else None
        self._compute = compute
        # (step, round) this replica contributed to in the current attempt at a step (see :meth:`fetch`).
        self._attempt: tuple[int, int] | None = None

    @property
    def bytes_sent(self) -> int:
        return self.averager.bytes_sent

    async def _run(self, fn, *args):  # noqa: ANN001, ANN202 - a torch computation off the event loop
        return await trio.to_thread.run_sync(fn, *args, limiter=self._compute)

    def begin(self, step: int) -> None:
        self._attempt = None
        if self._slices is not None:
            self._slices.begin(step)
        if self._power is not None:
            self._power.begin(step)

    async def average(self, step: int, round_id: int, weights: dict[str, float], grad: torch.Tensor) -> Averaged:
        """Average ``grad`` (this replica's summed gradient, (numel,)) over ``weights``' replicas in ``round_id``
        (phase 0 of the step's revision); raises :class:`~protolearn.node.averaging.AveragingError` if a round fails."""
        self.begin(step)
        if weights.get(self.averager.host.peer_id, 0.0) > 0:
            self._attempt = (step, round_id)
        if self._power is not None:
            return await self._power_average(step, round_id, weights, grad)
        vector = grad
        if self._slices is not None and weights.get(self.averager.host.peer_id, 0.0) > 0:
            vector = await self._run(self._slices.contribution, step, grad, part_bounds(grad.numel(), len(weights)))
        done = await self.averager.run_round_detailed(round_id, weights, vector, codec=self.codec)
        return Averaged(done.result, done.digest, list(done.excluded))

    async def _power_average(self, step: int, round_id: int, weights: dict[str, float], grad: torch.Tensor) -> Averaged:
        power, lay = self._power, self._power.layout  # type: ignore[union-attr]
        assert power is not None
        contributes = weights.get(self.averager.host.peer_id, 0.0) > 0
        p_own = await self._run(power.first, grad) if contributes else torch.zeros(lay.p_numel)
        a = await self.averager.run_round_detailed(round_id, weights, p_own)
        excluded = set(a.excluded)
        q_sum = torch.zeros(0)
        if lay.q_numel:
            # Round B among round A's survivors: every survivor holds the same A, so the same participants.
            q_own = await self._run(power.second, step, a.result) if contributes else torch.zeros(lay.q_numel)
            b = await self.averager.run_round_detailed(phase_round(round_id, 1), {p: w for p, w in weights.items() if p not in excluded}, q_own)
            q_sum, excluded = b.result, excluded | set(b.excluded)
        elif contributes:
            await self._run(power.second, step, a.result)  # stages a zero residual: every tensor went raw
        update = await self._run(power.finish, step, a.result, q_sum)
        return Averaged(update, vector_digest(update, len(weights)), sorted(excluded))

    async def fetch(self, step: int, round_id: int, weights: dict[str, float]) -> torch.Tensor:
        """The step's update from its other participants (``weights``: the round's, as the accounting gives
        them): this replica was left out, or its own round failed while the others finished. Every round
        taken is proven by a strict majority of the participants' signed fins over exactly the vector taken
        (:mod:`protolearn.node.result_fetch`): the raw round, a slice-compressed round (its digest binds the
        compression, so a fin of another mode proves nothing), or both PowerSGD factor rounds, each of its own
        length, decoded by every replica alike. PowerSGD's round A is taken first, and only a full round is
        served, so its round B ran over all of ``weights``, against which it is proven; a round B over fewer
        participants has no such proof and is not taken: the fetch fails (the core redoes or resyncs) rather
        than take an unproven vector. Raises what :meth:`Averager.fetch_result` raises.

        A proven result is a full average, so when this replica contributed to this very round (its own round
        failed here after it sent), its signed contribution is in it: it keeps what its attempt staged (the
        residual it left), as if its round had finished here. Otherwise it starts the step afresh and keeps
        its residual. (A PowerSGD contributor whose round A failed here never sent round B, so the others'
        round B left it out and is not served: that fetch fails and the step is redone.)"""
        if self._attempt != (step, round_id):
            self.begin(step)
        if self._power is None:
            return await self.averager.fetch_result(round_id, weights, codec=self.codec)
        lay = self._power.layout
        p_sum = await self.averager.fetch_result(round_id, weights, lay.p_numel)
        q_sum = await self.averager.fetch_result(phase_round(round_id, 1), weights, lay.q_numel) if lay.q_numel else torch.zeros(0)
        return await self._run(self._power.finish, step, p_sum, q_sum)

    def fetch_time_s(self) -> float:
        """How long :meth:`fetch` of a step's update may take on this replica's link (:meth:`Averager.fetch_time_s`)."""
        return self.averager.fetch_time_s()

    def commit(self, step: int) -> None:
        """``step`` was applied here: its residual (and warm start) become this replica's."""
        if self._slices is not None:
            self._slices.commit(step)
        if self._power is not None:
            self._power.commit(step)

    def reset(self) -> None:
        """This replica takes another state (a resync, a join, a checkpoint restore): start the compression afresh."""
        self._attempt = None
        if self._slices is not None:
            self._slices.reset()
        if self._power is not None:
            self._power.reset()
