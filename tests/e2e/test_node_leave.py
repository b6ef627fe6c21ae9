"""SIGTERM makes a node leave the coordinator; the coordinator does not have to expire it.

A lone stage-0 node of a two-stage run waits for a stage-1 replica, heartbeating. Stopped with
SIGTERM (as ``timeout 60 protolearn node join ...`` does), it used to lose its libp2p swarm before its
goodbye: node.log showed "Lifecycle reconcile pruned 1 phantom connection(s)" and ``[ADDCONN_FAIL]
... LifecycleError('Cannot schedule task after service has stopped')``, and the coordinator logged
``expired peer=...`` seconds later. See "Lifetime" in :mod:`protolearn.protocol.transport`.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.e2e.test_swarm import TINY, Swarm

STARTUP_S = 120.0


def _wait_for_event(s: Swarm, name: str, event: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    log = s.tmp / name / "node.jsonl"
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        found = [d for d in map(json.loads, lines) if d["event"] == event]
        if found:
            return found[0]
        assert s.procs[name].poll() is None, f"{name} exited {s.procs[name].returncode}: {s.err(name)}"
        assert time.monotonic() < deadline, f"no {event!r} event from {name} in {timeout:.0f} s: {s.err(name)}"
        time.sleep(0.05)


def test_a_waiting_node_stopped_with_sigterm_leaves_the_coordinator(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=2, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    try:
        s.spawn("coord", "coordinator", "start", "--config", str(config), "--listen", "/ip4/127.0.0.1/tcp/0",
                "--data-dir", str(tmp_path / "coord"), "--log-level", "info")
        deadline = time.monotonic() + STARTUP_S
        while not (tmp_path / "coord.out").read_text().endswith("\n"):
            assert s.procs["coord"].poll() is None and time.monotonic() < deadline, s.err("coord")
            time.sleep(0.05)
        addr = (tmp_path / "coord.out").read_text().splitlines()[0]
        s.start_node("n0", addr)
        peer = _wait_for_event(s, "n0", "start", STARTUP_S)["peer_id"]
        assert _wait_for_event(s, "n0", "joined", STARTUP_S)["stage"] == 0  # and it waits for stage 1
        s.procs["n0"].send_signal(signal.SIGTERM)
        assert s.procs["n0"].wait(timeout=30) == 0, s.err("n0")
        # The node's own record of the goodbye: written only once the coordinator answered it.
        assert [d["reason"] for d in s.events("n0", "left")] == ["stopped"], (tmp_path / "n0" / "node.log").read_text()[-3000:]
        # The coordinator heard the leave itself (its log is written before it replies).
        assert f"leave peer={peer} stage=0" in s.err("coord")
        assert f"expired peer={peer}" not in s.err("coord")
        assert "ADDCONN_FAIL" not in (tmp_path / "n0" / "node.log").read_text()
    finally:
        s.stop()
