"""A starting node waits for a coordinator that is down (restarting) instead of exiting after one dial.

Once a node restarted right after a SIGKILL, while the coordinator was down for 3 s, and exited 1
after one failed dial. Now ``node join`` retries for ``--coordinator-wait`` seconds, saying what it
waits for; when the time is up it exits 1 with the one error line it always printed.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from protolearn.protocol.identity import load_or_create_identity
from tests.support.cli import CLI
from tests.support.ports import free_port
from tests.support.swarm import Swarm, TINY

STARTUP_S = 90.0


def test_a_node_started_before_the_coordinator_waits_then_joins_and_trains(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=2, codec="none", layers=1, stages=1))
    # The coordinator's address is known before it runs: its key is in its data dir, its port chosen here.
    coord_dir = tmp_path / "coord"
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{load_or_create_identity(coord_dir).peer_id}"
    s = Swarm(tmp_path, config)
    try:
        s.start_node("n0", addr, "--coordinator-wait", "120")
        # Down long enough for the node to retry twice (about 3 s with the coordinator's own start).
        s.wait_alive("its retry line", lambda: f"waiting for the coordinator at {addr} (attempt 2, retry in" in s.err("n0"), STARTUP_S, "n0")
        s.spawn("coord", "coordinator", "start", "--config", str(config), "--listen", addr.rpartition("/p2p/")[0],
                "--data-dir", str(coord_dir), "--log-level", "warning")
        s.wait_nodes(["n0"], 240)
    finally:
        s.stop()
    assert [d["step"] for d in s.events("n0", "step")] == [0, 1]
    assert "error:" not in s.err("n0") and "Traceback" not in s.err("n0")


def test_with_a_short_wait_and_no_coordinator_a_node_exits_1_with_one_error_line(tmp_path: Path) -> None:
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{load_or_create_identity(tmp_path / 'nobody').peer_id}"
    started = time.monotonic()
    r = subprocess.run([*CLI, "node", "join", "--coordinator", addr, "--data-dir", str(tmp_path / "n"), "--coordinator-wait", "2"],
                       capture_output=True, text=True, timeout=STARTUP_S, check=False)
    took = time.monotonic() - started
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], r.stderr
    assert errors[0].startswith(f"error: cannot reach the coordinator at {addr} (waited 2 s, ") and "coordinator is running" in errors[0]
    # what it waited for, attempt by attempt, each on one line
    waits = [line for line in lines if "waiting for the coordinator" in line]
    assert waits and f"waiting for the coordinator at {addr} (attempt 1, retry in " in waits[0], r.stderr
    assert len(lines) == len(waits) + 1, r.stderr
    assert "Traceback" not in r.stderr
    # 2 s of retries plus the last dial's deadline (MIN_DIAL_S) and the interpreter's start-up.
    assert took < 40, f"took {took:.1f} s"
