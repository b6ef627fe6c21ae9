"""Serving a saved model's stages over the state-sync protocol, as if it were a replica of each.

Once a run finishes, its nodes leave; the coordinator keeps the final model it fetched from them
(``<data dir>/final``, written by :func:`~protolearn.node.export.write_model`) and answers state
requests for every stage from it with :class:`ModelServer`, so ``protolearn swarm export`` and
``protolearn generate --coordinator`` work after the run. The file is loaded (and checked against its
digest, :func:`~protolearn.node.export.load_model`) once, on the first request, in a worker thread.
It holds parameters only: an exported model carries no optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import trio
from protolearn.node.checkpoint import Snapshot, shared_leaves
from protolearn.node.export import load_model, read_model_info
from protolearn.node.state_sync import StateServer
from protolearn.protocol.pipeline import Refuse
from protolearn.protocol.transport import Host
from protolearn.stages.stage import StageModule, build_stage, state_root


class ModelServer(StateServer):
    """Every stage of the model file at ``path``, after its step, to whoever asks."""

    def __init__(self, host: Host, path: Path) -> None:
        info = read_model_info(path)
        self.path = Path(path)
        self.run = info.run()
        self.step = info.step
        self._stages: list[StageModule] | None = None
        self._lock = trio.Lock()
        super().__init__(host, -1, info.run_hash, self._no_snapshot)

    async def _no_snapshot(self) -> Snapshot | None:
        return None

    def _load(self) -> list[StageModule]:
        stages = [build_stage(self.run, s) for s in range(self.run.stages.num_stages)]
        load_model(self.path, stages)
        return stages

    async def snapshot_of(self, stage: int) -> Snapshot | Refuse:
        async with self._lock:
            if self._stages is None:
                self._stages = await trio.to_thread.run_sync(self._load)
        if not 0 <= stage < len(self._stages):
            return Refuse(code="stage", reason=f"the model has stages 0..{len(self._stages) - 1}, not {stage}")
        module = self._stages[stage]

        def take() -> Snapshot:
            entries = [(f"param/{n}", p.detach().cpu().clone()) for n, p in module.named_parameters()]
            # Parameters alone: what shared_state_hash gives a taker that installs them with no optimizer state.
            leaves = shared_leaves(entries, diloco=False)
            return Snapshot(self.step, state_root(leaves), entries, b"", leaves)

        return await trio.to_thread.run_sync(take)
