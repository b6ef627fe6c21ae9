"""Issue 11 as a user meets it: one of 3 stage-0 nodes accepts leases and never delivers (``--adversary
blackhole:2``). ``scripts/bench_blackhole.py --quick`` runs the honest swarm and then the one with the
blackhole, through the CLI as subprocesses; the blackhole must be banned for liveness within 20 of its
leases, no honest node banned, the run finished, and the swarm's tokens/s after the ban not stalled.

The two runs are timed one after the other, so their tokens/s ratio carries whatever the machine's load
did between them. Its goal (>= 0.9 of the honest run) is the benchmark's, measured on a quiet machine
(``python scripts/bench.py integrity --json``, whose blackhole row runs this swarm; docs/BENCHMARKS.md); this test asserts only what no load
can explain: a swarm that stalled after the ban (a ratio under 0.3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_stage0_blackhole_is_expelled_and_throughput_recovers(tmp_path: Path) -> None:
    argv = [sys.executable, "scripts/bench_blackhole.py", "--quick", "--workdir", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["banned"], r
    assert r["banned_reason"].startswith("liveness: held ") and "without completing any" in r["banned_reason"], r
    assert r["leases_until_ban"] is not None and r["leases_until_ban"] <= 20, r
    assert r["honest_banned"] == [] and r["nodes_joined"] == [3, 3], r
    assert r["steps_closed"] == [r["steps"], r["steps"]], r  # both runs finished every step
    honest_codes = [c for k, c in r["exit_codes"]["blackhole"].items() if k != "0"]
    assert honest_codes == [0, 0] and set(r["exit_codes"]["honest"].values()) == {0}, r
    print(f"tokens/s with the blackhole banned / honest: {r['ratio']}")
    assert r["ratio"] is not None and r["ratio"] >= 0.3, r
