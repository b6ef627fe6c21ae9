"""The simulated coordinator: the real :class:`~protolearn.coordinator.core.dispatch.CoordinatorCore`, its SQLite
store, its housekeeping timer, and a crash with a restart.

What ``coordinator/service.py`` does around the core, minus the sockets: every request goes to
:meth:`CoordinatorCore.handle` with the simulated ``now``; connection opens and closes go to
:meth:`~CoordinatorCore.connection_changed`; :meth:`~CoordinatorCore.housekeeping` runs every
``housekeeping_interval_s``. While the coordinator is down every request raises :class:`Unavailable` (as
a failed dial does). A crash drains the core's changes into a real :class:`~protolearn.coordinator.store.Store`
(the service persists every change before it replies, so that is what a restarted coordinator finds),
and the restart builds a new core and restores it from the store.

The host times the core's CPU (thread CPU time around every call), for the report's
``coordinator_cpu_per_s``, and watches the ledger after each call: a step that closed, reopened or
committed is announced to the listeners (the simulated nodes' long polls, :mod:`.swarm`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.store import Store
from protolearn.protocol import coordination as cm
from protolearn.sim.engine import Engine
from protolearn.sim.signatures import sim_verify

PEER_ID = "sim-coordinator"  # the simulated coordinator's peer id
# The service persists after every change; the simulation drains the core this often (and at a crash).
DRAIN_S = 10.0


class Unavailable(Exception):
    """The coordinator is down: the request failed as a dial would."""


class CoordinatorHost:
    """The coordinator core in the simulation, with its timers, store and CPU meter."""

    def __init__(
        self, engine: Engine, run: RunInfo, settings: CoordinatorSettings, *, persist: bool = False, data_dir: Path | None = None,
    ) -> None:
        """``persist``: keep a real SQLite store (needed for a restart); otherwise the drained changes are dropped."""
        self.engine = engine
        self.run = run
        self.settings = settings
        self.core = self._new_core(0.0)
        self.down_until = -1.0
        self.cpu_s = 0.0
        self.calls = 0
        self.restarts = 0
        self._data_dir = data_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store: Store | None = None
        self._open_step = 0
        self._committed = self.core.ledger.committed_through
        # Listeners: on_closed(step, revision), on_reopened(step), on_committed(step).
        self.on_closed: Callable[[int, int], None] = lambda step, revision: None
        self.on_reopened: Callable[[int], None] = lambda step: None
        self.on_committed: Callable[[int], None] = lambda step: None
        # Peers whose connection is closed now (a restarted core must hear of them again).
        self.disconnected: set[str] = set()
        engine.after(settings.housekeeping_interval_s, self._housekeeping)
        if persist:
            self._open_store()
        engine.after(DRAIN_S, self._drain)

    def _new_core(self, now: float) -> CoordinatorCore:
        return CoordinatorCore(self.run, self.settings, peer_id=PEER_ID, started_at=now, verify=sim_verify)

    @property
    def up(self) -> bool:
        return self.engine.now >= self.down_until

    @property
    def heartbeat_interval_s(self) -> float:
        pacing = getattr(self.core, "pacing", None)
        return float(pacing.interval_s) if pacing is not None else self.settings.heartbeat_interval_s

    # -- requests ------------------------------------------------------------------------------
    def request(self, peer: str, msg: cm.Message) -> cm.Message:
        """One request now; raises Refusal (the core's), or Unavailable while the coordinator is down."""
        if self.engine.now < self.down_until:
            raise Unavailable("the coordinator is restarting")
        t0 = time.thread_time()
        try:
            return self.core.handle(peer, msg, self.engine.now)
        finally:
            self.cpu_s += time.thread_time() - t0
            self.calls += 1
            self._watch()

    def step_info(self, step: int, min_revision: int = 1) -> cm.StepInfo | None:
        """The long poll's answer now (None while down)."""
        if self.engine.now < self.down_until:
            return None
        t0 = time.thread_time()
        try:
            return self.core.step_info(step, min_revision)
        finally:
            self.cpu_s += time.thread_time() - t0
            self.calls += 1

    def connection_changed(self, peer: str, connected: bool) -> None:
        if connected:
            self.disconnected.discard(peer)
        else:
            self.disconnected.add(peer)
        if self.engine.now < self.down_until:
            return
        t0 = time.thread_time()
        self.core.connection_changed(peer, connected, self.engine.now)
        self.cpu_s += time.thread_time() - t0
        self._watch()

    def _housekeeping(self) -> None:
        if self.engine.now >= self.down_until:
            t0 = time.thread_time()
            self.core.housekeeping(self.engine.now)
            self.cpu_s += time.thread_time() - t0
            self._watch()
        self.engine.after(self.settings.housekeeping_interval_s, self._housekeeping)

    def _watch(self) -> None:
        """Announce what the last call changed in the ledger: closes, a reopen, a commit."""
        ledger = self.core.ledger
        step, prev = ledger.step, self._open_step
        if step != prev:
            self._open_step = step
            if step > prev:
                for s in range(prev, step):
                    closed = ledger.closed.get(s)
                    if closed is not None:
                        self.on_closed(s, closed.revision)
            else:
                self.on_reopened(step)
        committed = ledger.committed_through
        if committed > self._committed:
            self._committed = committed
            self.on_committed(committed)

    # -- persistence, a crash and a restart -------------------------------------------------------
    def _open_store(self) -> Store:
        if self._store is None:
            if self._data_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="protolearn-sim-")
                self._data_dir = Path(self._tmp.name)
            self._store = Store(self._data_dir)
        return self._store

    def _drain(self) -> None:
        if self.engine.now >= self.down_until:
            changes = self.core.drain()
            if self._store is not None:
                self._store.apply(changes)
        self.engine.after(DRAIN_S, self._drain)

    def crash(self, outage_s: float) -> None:
        """The coordinator dies now and comes back ``outage_s`` later from what it had persisted."""
        self._open_store().apply(self.core.drain())
        self.down_until = self.engine.now + outage_s
        self.restarts += 1
        self.engine.at(self.down_until, self._restart)

    def _restart(self) -> None:
        assert self._store is not None
        now = self.engine.now
        t0 = time.thread_time()
        self.core = self._new_core(now)
        self.core.restore(**self._store.load(), now=now)
        for peer in sorted(self.disconnected):
            self.core.connection_changed(peer, False, now)
        self.cpu_s += time.thread_time() - t0
        self._open_step = self.core.ledger.step
        self._committed = self.core.ledger.committed_through

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        if self._tmp is not None:
            self._tmp.cleanup()
