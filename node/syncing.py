"""Where a (re)starting or lagging replica takes its stage's state from, and the checks before it installs it.

:meth:`StageSync.sync` asks the persistence planner first (a checkpoint of this node, or the
deterministic init on a fresh run: :mod:`protolearn.node.persistence`); otherwise it downloads from
the stage's live replicas (a share from each, or everything from one: :mod:`protolearn.node.state_sync`)
and installs a state only if it hashes to what the donors claimed and to what the stage's other
replicas reported to the coordinator for the same step. While the coordinator lists a live replica, a
failed download is retried and never replaced by an older checkpoint (I2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import trio
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.node.errors import StateSyncError
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.state_sync import fetch_state, fetch_state_split
from protolearn.node.worker import StageWorker
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")
# A failed state download is retried this often while the stage has live replicas.
SYNC_RETRY_S = 1.0


class StageSync:
    """Syncs one built stage; the node makes one per build."""

    def __init__(
        self, config: NodeConfig, host: Host, link: CoordinatorLink, worker: StageWorker, persistence: StagePersistence,
        compute: trio.CapacityLimiter, progress: Progress, *, stage: int, run_hash: str, donors: Callable[[], list[str]],
        say_waiting: Callable[[str], None], clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.config = config
        self.host = host
        self.link = link
        self.worker = worker
        self.persistence = persistence
        self.compute = compute
        self.progress = progress
        self.stage = stage
        self.run_hash = run_hash
        self.donors = donors
        self.say_waiting = say_waiting
        self.clock = clock

    async def sync(self, open_step: int) -> int:
        """Take the stage's state from a live replica, or keep the deterministic init on a fresh run.

        The installed state must hash to what the donor claims and to what every replica of the stage
        reported to the coordinator for the same step. While the coordinator lists a live replica, a
        failed download is retried (the list is refreshed by the heartbeats: a dead replica drops out
        when it expires) and never replaced by an older checkpoint, which would make this replica
        diverge from its stage (I2). Only a stage with no live replica left restores a checkpoint.
        """
        deadline = self.clock() + self.config.sync_timeout_s
        tried, last, planned_for = 0, "", None
        while True:
            donors = self.donors()
            # A local or given checkpoint, the init, or (None) a download: see node/persistence.py.
            if donors != planned_for:
                planned_for = donors
                restored = await self.persistence.restore(
                    self.stage, self.worker, open_step if not tried else self.link.step, donors, self._reported_list,
                )
                if restored is not None:
                    return restored
            # Several replicas each send a share (a hivemind newcomer loads everything from one); if
            # that fails, or they disagree, one replica at a time sends everything.
            attempts = [donors] if len(donors) > 1 else []
            for source in attempts + [[d] for d in donors]:
                tried += 1
                try:
                    if len(source) > 1:
                        applied, claimed, entries = await fetch_state_split(self.host, source, self.worker, self.run_hash, timeout_s=self.config.sync_timeout_s)
                    else:
                        applied, claimed, entries = await fetch_state(self.host, source[0], self.worker, self.run_hash, timeout_s=self.config.sync_timeout_s)
                    await self._install(source, applied, claimed, entries)
                except (ProtocolError, StateSyncError) as err:
                    last = str(err)
                    log.warning("state sync failed donors=%s reason=%s", source, last)
                    continue
                return applied
            if self.clock() > deadline:
                raise StateSyncError(
                    f"could not sync stage {self.stage} from its replicas within {self.config.sync_timeout_s:g} s "
                    f"({tried} attempts, last: {last}); restart the node to try again"
                )
            self.say_waiting(f"syncing stage {self.stage}: no replica handed over its state yet" if donors else "")
            await trio.sleep(SYNC_RETRY_S)

    async def _install(self, donors: list[str], applied: int, claimed: str, entries: dict[str, torch.Tensor]) -> None:
        """Install downloaded state if it hashes to what the donors claimed and the stage's replicas report."""
        got = await trio.to_thread.run_sync(self.worker.load, entries, limiter=self.compute)
        if got != claimed:
            raise StateSyncError(f"state from {donors} hashes to {got[:12]}, they claimed {claimed[:12]}")
        reported = await self.reported_hashes(applied - 1)
        if reported and any(h != got for h in reported.values()):
            raise StateSyncError(
                f"state from {donors} hashes to {got[:12]}, but replicas report {sorted({h[:12] for h in reported.values()})} for step {applied - 1}"
            )
        self.progress.event("synced", donor=donors[0], donors=donors, applied=applied, hash=got)

    async def reported_hashes(self, step: int) -> dict[str, str]:
        """The parameter hashes this stage's other replicas reported for ``step`` (empty if unknown)."""
        if step < 0:
            return {}
        return {p: h for p, (s, h) in (await self._reported()).items() if s == step}

    async def _reported_list(self) -> list[tuple[int, str]]:
        return list((await self._reported()).values())

    async def _reported(self) -> dict[str, tuple[int, str]]:
        """peer → (step, parameter hash) as this stage's other replicas reported them (empty if unknown)."""
        try:
            reported = await self.link.stage_hashes(self.stage)
        except ProtocolError as err:
            log.info("stage hashes request failed reason=%s", err.reason)
            return {}
        return {ph.peer_id: (ph.step, ph.hash) for ph in reported if ph.hash and ph.peer_id != self.host.peer_id}
