"""I2, replica consistency, as each replica checks it: its parameter hash after each step against those
its stage's other replicas report.

A replica records the hash of its parameters after each step it applies (:meth:`ReplicaHashes.record`)
and reports the latest ones in its heartbeat (:meth:`ReplicaHashes.latest`, :meth:`ReplicaHashes.recent`).
Every heartbeat interval it asks the coordinator what its stage's replicas reported
(:meth:`ReplicaHashes.check`) and compares each step once: a replica whose hash differs is an error on
the progress line, the event log (``replica_mismatch``) and the log. A replica that disagrees with its
stage's majority is resynced by the commit barrier; this check makes any divergence visible. The
bookkeeping covers the last few steps only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.node.progress import Progress
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError

log = logging.getLogger("protolearn.node")
# Steps kept behind the applied one.
KEEP_STEPS = 8


class ReplicaHashes:
    """This replica's parameter hash per applied step, and the check of its stage's replicas' against it."""

    def __init__(self, link: CoordinatorLink, progress: Progress, me: str, *, applied: Callable[[], int]) -> None:
        """``applied``: the steps this node's stage has applied now."""
        self.link = link
        self.progress = progress
        self.me = me
        self.applied = applied
        self._by_step: dict[int, str] = {}
        self._checked: set[int] = set()
        self._served = -1

    def clear(self) -> None:
        """A new stage was built: its hashes start afresh."""
        self._by_step.clear()
        self._checked.clear()
        self._served = -1

    def served(self, applied: int) -> None:
        """This replica's state after ``applied`` steps was just served. Its taker checks it against the hashes
        the stage reported (node/syncing.py), so the heartbeat that reports this one's goes now, not an
        interval later (issue 28: the joiner waited a check poll for it). Once per applied count: anyone may
        ask for the state, and asking again must not make this node beat again (costs go to their cause)."""
        if applied != self._served:
            self._served = applied
            self.link.beat_now()

    def record(self, step: int, param_hash: str) -> None:
        self._by_step[step] = param_hash

    def latest(self, applied: int) -> str:
        """The hash after the last applied step ("" when unknown)."""
        return self._by_step.get(applied - 1, "")

    def recent(self, applied: int) -> list[cm.RecentHash]:
        """The hashes of the last applied steps, oldest first (the heartbeat carries at most HASH_HISTORY)."""
        return [cm.RecentHash(step=s, hash=h) for s, h in sorted(self._by_step.items()) if s < applied][-cm.HASH_HISTORY:]

    async def check_loop(self, interval_s: float, stage: Callable[[], int], *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every ``interval_s``, :meth:`check` the stage this node serves then."""
        task_status.started()
        while True:
            await trio.sleep(interval_s)
            await self.check(stage())

    async def check(self, stage: int) -> None:
        """Compare this replica's hash after each step with what ``stage``'s replicas report."""
        pending = [s for s in self._by_step if s not in self._checked]
        if not pending:
            return
        try:
            reported = await self.link.stage_hashes(stage)
        except ProtocolError as err:
            log.info("stage hashes request failed reason=%s", err.reason)
            return
        for ph in reported:
            mine = self._by_step.get(ph.step)
            if ph.peer_id == self.me or mine is None or not ph.hash or ph.step not in pending:
                continue
            if ph.hash != mine:
                self.progress.event("replica_mismatch", step=ph.step, peer=ph.peer_id, theirs=ph.hash, mine=mine)
                self.progress.say(f"error: after step {ph.step} replica {ph.peer_id[-8:]} has parameter hash {ph.hash[:12]}, this replica {mine[:12]}")
                log.error("replica mismatch step=%d peer=%s theirs=%s mine=%s", ph.step, ph.peer_id, ph.hash, mine)
            self._checked.add(ph.step)
        # Keep the bookkeeping bounded.
        applied = self.applied()
        for s in [s for s in self._by_step if s < applied - KEEP_STEPS]:
            self._by_step.pop(s, None)
            self._checked.discard(s)
