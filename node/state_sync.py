"""Handing a stage's parameters and optimizer state to a replica that joins.

The donor side answers a :class:`StateRequest` with :class:`StateInfo` (applied steps, run hash,
parameter hash, tensor count) and then each tensor as a :class:`StateChunk` naming it plus the raw
tensor. The snapshot is taken between optimizer steps (the node holds its step lock), so it is one
consistent state.

The joining side checks everything before installing it: the run hash, that every name is one of its
own parameters or their AdamW moments with the exact dtype and shape (the header is checked before the
payload is read), finiteness, and finally that the installed parameters hash to what the donor
claimed and to what the stage's other replicas report to the coordinator, when they report that step.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch
import trio

from protolearn.node.errors import StateSyncError
from protolearn.node.worker import StageWorker
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import STATE, Refuse, StateChunk, StateInfo, StateRequest
from protolearn.protocol.transport import FramedStream
from protolearn.protocol.tensors import TensorLimits, from_frame, to_frame
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")

Snapshot = tuple[int, str, list[tuple[str, torch.Tensor]]]  # (applied, param hash, entries)


class StateServer:
    """Serves this replica's state; ``take_snapshot`` returns it between steps (None while syncing)."""

    def __init__(self, host: Host, stage: int, run_hash: str, take_snapshot: Callable[[], Awaitable[Snapshot | None]]) -> None:
        self.host = host
        self.stage = stage
        self.run_hash = run_hash
        self.take_snapshot = take_snapshot

    def register(self) -> None:
        self.host.serve_stream(STATE, self._handle, max_inbound=4)

    async def _handle(self, peer: str, s: FramedStream) -> None:
        req = await s.receive(StateRequest)
        if req.stage != self.stage:
            await s.send(Refuse(code="stage", reason=f"this replica serves stage {self.stage}, not {req.stage}"))
            return
        snap = await self.take_snapshot()
        if snap is None:
            await s.send(Refuse(code="state", reason="this replica is still syncing its own state"))
            return
        applied, param_hash, entries = snap
        await s.send(StateInfo(stage=self.stage, applied=applied, run_hash=self.run_hash, param_hash=param_hash, num_tensors=len(entries)))
        for i, (name, t) in enumerate(entries):
            await s.send(StateChunk(index=i, name=name))
            await s.send_tensor(to_frame(t))
        log.info("state served peer=%s stage=%d applied=%d tensors=%d", peer, self.stage, applied, len(entries))


async def fetch_state(host: Host, donor: str, worker: StageWorker, run_hash: str, *, timeout_s: float) -> tuple[int, str, dict[str, torch.Tensor]]:
    """Download and validate ``donor``'s state for ``worker``'s stage; returns (applied, hash, entries).

    Nothing is installed here; the caller installs in its compute thread and compares hashes.
    """
    entries: dict[str, torch.Tensor] = {}
    biggest = max((p.numel() for p in worker.params), default=1)
    limits = TensorLimits(max_elements=biggest, max_bytes=8 * biggest + 64)
    try:
        with trio.fail_after(timeout_s):
            async with host.open_stream(donor, STATE) as s:
                await s.send(StateRequest(stage=worker.stage))
                info = await s.receive((StateInfo, Refuse))
                if isinstance(info, Refuse):
                    raise StateSyncError(f"replica {donor} refused to share its state: {info.reason}")
                if info.stage != worker.stage or info.run_hash != run_hash:
                    raise StateSyncError(f"replica {donor} offered stage {info.stage} of run {info.run_hash[:12]}, not stage {worker.stage} of {run_hash[:12]}")
                if info.num_tensors > 4 * len(worker.names):
                    raise ProtocolError(donor, f"state of {info.num_tensors} tensors; stage {worker.stage} has at most {4 * len(worker.names)}")
                for i in range(info.num_tensors):
                    chunk = await s.receive(StateChunk)
                    want = worker.expected(chunk.name)
                    if chunk.index != i or want is None or chunk.name in entries:
                        raise ProtocolError(donor, f"unexpected state tensor #{chunk.index} {chunk.name[:80]!r}")
                    dtype, shape = want
                    frame = await s.receive_tensor(codec="none", dtype=dtype, shape=shape, limits=limits)
                    entries[chunk.name] = from_frame(frame, peer=donor, dtype=dtype, shape=shape, limits=limits, require_finite=True)
    except trio.TooSlowError:
        raise StateSyncError(f"state sync from replica {donor} did not finish within {timeout_s:g} s") from None
    missing = [n for n in worker.names if f"param/{n}" not in entries]
    if missing:
        raise ProtocolError(donor, f"state lacks {len(missing)} parameters, e.g. {missing[0]}")
    return info.applied, info.param_hash, entries
