"""What a replica keeps of the collective rounds it finished, for the peers that come asking after.

Two kinds of peer still ask about a round after it finished here:

- a participant that missed this replica's fin **probes** the round: it gets the signed fin back (or the
  vetoing fin of a round this replica vetoed), or, if the round failed here, a ``Refuse`` with code
  ``left``, so that it stops waiting for this replica (:meth:`FinishedRounds.fin`);
- a replica the step's accounting **left out** (it processed no ticket), or a participant whose own round
  failed, asks for the round's vector and applies exactly the same update (:meth:`FinishedRounds.serve`).
  Only a full average is served, with the signed fins this replica holds, which the taker checks: a
  strict majority of the participants must have signed it (:mod:`protolearn.protocol.collective.result_proof`).
  Every round is served alike, whatever its vector (a compressed sync's round, or either of PowerSGD's
  factor rounds, :mod:`protolearn.node.replica_sync`), with that round's own fins.
  A round that left a replica out is redone at the next revision, and a replica that fetched a result
  reports holding the step, which counts for the commit. A request that arrives before the round finished
  here waits for it, up to the round timeout.

Rounds are kept for the last two steps' worth of revisions (their ids are sparse, see
:func:`~protolearn.protocol.rounds.round_id`), so memory stays bounded.
"""

from __future__ import annotations

import torch
import trio
from protolearn.protocol.collective import PartHeader
from protolearn.protocol.collective.result_proof import HeldFin
from protolearn.protocol.pipeline import Refuse, ResultServed, ServedFin
from protolearn.protocol.rounds import PHASES_PER_REVISION, REVISIONS_PER_STEP, revision_index
from protolearn.protocol.tensors import TensorFrame
from protolearn.protocol.transport import FramedStream

# Rounds kept behind the last one finished here.
KEEP_ROUNDS = 2 * REVISIONS_PER_STEP * PHASES_PER_REVISION


def borrowed_frame(t: torch.Tensor) -> TensorFrame:
    """A raw float32 frame whose payload is a view of ``t``'s memory: a part is 16 MiB for a 64 MiB vector,
    and ``to_frame``'s copy of it cost more CPU than sending it over the bulk lane. Parts and results never
    change once the round hands them out, so sending from their memory is safe."""
    t = t.detach().to("cpu", torch.float32).contiguous().reshape(-1)  # (N,)
    # TensorFrame.data is bytes on the wire; a memoryview is what send_tensor reads it through anyway.
    data = memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""
    return TensorFrame.model_construct(codec="none", dtype="float32", shape=list(t.shape), data=data, aux=b"")


class FinishedRounds:
    """The fins and full results of the rounds this replica finished (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # round → the signed fin this replica sent, or None if the round failed here
        self._fins: dict[int, PartHeader | None] = {}
        self._results: dict[int, tuple[torch.Tensor, list[HeldFin]]] = {}
        self._ready: dict[int, trio.Event] = {}

    def ended(self, round_id: int, fin: PartHeader | None) -> None:
        """Round ``round_id`` ended here, with ``fin`` sent (None: it failed here, and a request for its result
        is answered ``left`` at once)."""
        self._fins[round_id] = fin
        self._fins = {k: v for k, v in self._fins.items() if k >= round_id - KEEP_ROUNDS}
        if fin is None:
            self._ready.setdefault(round_id, trio.Event()).set()

    def ended_here(self, round_id: int) -> bool:
        return round_id in self._fins

    def fin(self, round_id: int) -> PartHeader | None:
        """The fin of a round that :meth:`ended_here` (None: it failed here)."""
        return self._fins[round_id]

    def done(self, round_id: int, result: torch.Tensor | None, fins: list[HeldFin] | None = None) -> None:
        """Round ``round_id`` finished with ``result`` (None: it left a replica out, so it is not served) and
        the ``fins`` that prove it."""
        self._results = {k: v for k, v in self._results.items() if k >= round_id - KEEP_ROUNDS}
        if result is not None:
            self._results[round_id] = (result, list(fins or ()))
        self._ready.setdefault(round_id, trio.Event()).set()
        self._ready = {k: v for k, v in self._ready.items() if k >= round_id - KEEP_ROUNDS}

    async def serve(self, s: FramedStream, round_id: int, next_round: int) -> None:
        """Answer a left-out replica's request for round ``round_id``'s result."""
        if round_id not in self._results and not -1 <= revision_index(round_id) - revision_index(next_round) <= 1:
            await s.send(Refuse(code="stale", reason=f"round {round_id} is not kept (next round {next_round})"))
            return
        ready = self._ready.setdefault(round_id, trio.Event())
        with trio.move_on_after(self.timeout_s):
            await ready.wait()
        served = self._results.get(round_id)
        if served is None and round_id in self._fins and self._fins[round_id] is None:
            await s.send(Refuse(code="left", reason=f"round {round_id} failed here: it has no result"))
            return
        if served is None:
            await s.send(Refuse(code="state", reason=f"round {round_id} did not finish here within {self.timeout_s:g} s"))
            return
        result, fins = served
        await s.send(ResultServed(fins=[ServedFin(signer=f.signer, mask=f.mask, digest=f.digest, signature=f.signature) for f in fins]))
        await s.send_tensor(borrowed_frame(result))
