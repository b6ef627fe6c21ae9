"""The ``coordinator-net`` bench's load generator against a real ``coordinator start``: its path cannot rot.

Two ``scripts/coordinator_load.py`` processes, 20 member identities each, join a coordinator subprocess
over real Noise connections; every member is placed in a stage and its heartbeats are answered. Only
generous deadlines are asserted (a busy CI machine); the latencies are the bench's business.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEMBERS_PER_WORKER = 20


def test_load_members_join_are_placed_and_their_heartbeats_are_answered(tmp_path: Path) -> None:
    argv = [sys.executable, "scripts/bench.py", "coordinator-net", "--json", "--levels", str(2 * MEMBERS_PER_WORKER),
            "--workers", "2", "--join-rate", "20", "--window", "3", "--max-seconds", "60", "--workdir", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=150, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    [level] = result["levels"]
    # Every member joined, was placed in one of the demo run's two stages, and stayed (nobody expired or failed).
    assert level["members"] == level["target"] == 2 * MEMBERS_PER_WORKER, level
    assert set(level["stages"]) == {"0", "1"} and sum(level["stages"].values()) == level["members"], level
    assert level["failures"] == {} and level["expired"] == 0, level
    # A window of at least 3 s at a 1 s interval: every member beat at least once, and none waited 10 s.
    assert level["interval_s"] == 1.0 and level["heartbeats"] >= level["members"], level
    assert level["max_ms"] < 10_000, level
    assert level["coordinator_cpu_cores"] > 0 and level["rss_kb_per_member"] != 0, level
    # Both load generators and the coordinator were stopped.
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert {"coordinator.err", "load0.err", "load1.err"} <= set(logs), logs
    assert "Traceback" not in (tmp_path / "load0.err").read_text() + (tmp_path / "load1.err").read_text()
