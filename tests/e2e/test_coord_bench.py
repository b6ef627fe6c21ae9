"""`python scripts/bench.py coordinator`: one run measures every size and reports the growth ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_coordinator_suite_reports_each_size_and_the_heartbeat_growth() -> None:
    argv = [sys.executable, "scripts/bench.py", "coordinator", "--json", "--sizes", "20,300", "--repeat", "1", "--stages", "3"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["suite"] == "coordinator" and result["sizes"] == [20, 300]
    for n in (20, 300):
        for key in ("heartbeat_ms", "join_ms", "lease_ms", "status_ms", "join_reply_bytes", "view_reply_bytes", "view_delta_bytes"):
            assert result[f"{key}_{n}"] > 0, key
    assert result["heartbeat_growth"] == result["heartbeat_ms_300"] / result["heartbeat_ms_20"]


def test_a_bad_size_list_is_one_line() -> None:
    argv = [sys.executable, "scripts/bench.py", "coordinator", "--sizes", "ten"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert out.returncode == 2 and "--sizes: 'ten' must be comma-separated member counts" in out.stderr
