"""`python scripts/bench.py abuse --quick`: every attack runs against a real target and reports the honest side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repo
ATTACKS = ("idle_streams", "trickle_streams", "pre_round_flood", "bulk_slots", "bulk_threads", "join_flood", "view_flood")


def test_abuse_suite_reports_each_attack_and_the_honest_peer_is_served() -> None:
    argv = [sys.executable, "scripts/bench.py", "abuse", "--json", "--quick"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=180, check=True)
    result = json.loads(out.stdout)
    assert result["suite"] == "abuse" and set(result["attacks"]) == set(ATTACKS)
    for name, attack in result["attacks"].items():
        assert attack["honest_ok"] is True, (name, out.stderr[-2000:])
        assert attack["latency_ratio"] > 0 and isinstance(attack["mem_growth_bytes"], int), name
    # The attacks were really refused at the target's gates.
    assert result["attacks"]["idle_streams"]["node_rejected"] > 0 and result["attacks"]["idle_streams"]["coordinator_rejected"] > 0
    assert result["all_honest_ok"] is True
