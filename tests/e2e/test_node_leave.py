"""SIGTERM makes a node leave the coordinator; the coordinator does not have to expire it.

A lone stage-0 node of a two-stage run waits for a stage-1 replica, heartbeating. Stopped with
SIGTERM (as ``timeout 60 protolearn node join ...`` does), it used to lose its libp2p swarm before its
goodbye: node.log showed "Lifecycle reconcile pruned 1 phantom connection(s)" and ``[ADDCONN_FAIL]
... LifecycleError('Cannot schedule task after service has stopped')``, and the coordinator logged
``expired peer=...`` seconds later. See "Lifetime" in :mod:`protolearn.protocol.transport`.
"""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.swarm import Swarm, TINY

STARTUP_S = 120.0


def test_a_waiting_node_stopped_with_sigterm_leaves_the_coordinator(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=2, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    try:
        s.spawn("coord", *s.coordinator_args(config, tmp_path / "coord", "/ip4/127.0.0.1/tcp/0", "--log-level", "info"))
        s.wait_first_line("coord", STARTUP_S)
        addr = (tmp_path / "coord.out").read_text().splitlines()[0]
        s.start_node("n0", addr)
        peer = s.wait_alive("a start event from n0", lambda: s.events("n0", "start"), STARTUP_S, "n0")[0]["peer_id"]
        assert s.wait_alive("a joined event from n0", lambda: s.events("n0", "joined"), STARTUP_S, "n0")[0]["stage"] == 0  # and it waits for stage 1
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
