"""Bench suite ``simcurves``: the simulated swarm's goodput and tokens/s against its size, node lifetime and stages.

``python scripts/bench.py simcurves [--json] [--nodes 100,1000,10000] [--lifetimes 15m,1h,2h,6h,24h] [--stages 8,32]
[--hours 2] [--seed 1] [--point-timeout-s 1800] [--quick]``

Every point is one ``python scripts/simulate.py ... --json`` run of the built-in scenario (a 7B-class model on home
links, ``protolearn/sim/default.toml``) in a subprocess, with its command line kept beside its result. Three curves,
each varying one thing from the base point (1,000 nodes, 32 stages, a 2 h mean lifetime): node count, mean node
lifetime, and stages. A point that runs past ``--point-timeout-s`` is recorded as timed out, with no figures.
The whole grid takes about 15 minutes here without the 10,000-node point.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_NODES, BASE_STAGES, BASE_LIFETIME = 1000, 32, "2h"
# What each point keeps of simulate.py's report.
KEPT = ("goodput", "node_time_goodput", "busy_share", "lost", "tokens_per_s", "step_s", "steps", "events", "wall_s",
        "round_failures_per_step", "redone_tickets_per_step", "empty_neighbour_share", "coordinator_cpu_per_s")


def _point(axis: str, value: Any, nodes: int, stages: int, lifetime: str, hours: float, seed: int, timeout_s: float) -> dict[str, Any]:
    args = ["--nodes", str(nodes), "--stages", str(stages), "--mean-lifetime", lifetime, "--hours", f"{hours:g}", "--seed", str(seed), "--json"]
    point: dict[str, Any] = {"axis": axis, "value": value, "nodes": nodes, "stages": stages, "mean_lifetime": lifetime,
                             "command": "python scripts/simulate.py " + " ".join(args)}
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate.py"), *args], capture_output=True, text=True,
                             cwd=ROOT, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        point.update(timed_out=True, wall_s=round(time.perf_counter() - t0, 1))
        print(f"simcurves: {axis}={value} timed out after {timeout_s:g} s", file=sys.stderr)
        return point
    if out.returncode != 0:
        raise RuntimeError(f"{point['command']} failed: {out.stderr.strip()[-500:]}")
    result = json.loads(out.stdout)
    point.update({k: result.get(k) for k in KEPT}, timed_out=False)
    print(f"simcurves: {axis}={value} goodput {result['goodput']:.3f} tokens/s {result['tokens_per_s']:,.0f} "
          f"({result['wall_s']:.0f} s wall)", file=sys.stderr)
    return point


def run(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.py simcurves", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="100,1000,10000", help="node counts of the size curve (32 stages, 2 h lifetime)")
    p.add_argument("--lifetimes", default="15m,1h,2h,6h,24h", help="mean node lifetimes of the churn curve (1,000 nodes)")
    p.add_argument("--stages", default="8,32", help="stage counts of the depth curve (1,000 nodes, 2 h lifetime)")
    p.add_argument("--hours", type=float, default=2.0, help="simulated hours per point")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--point-timeout-s", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="a small grid (64 and 128 nodes, 8 stages, half an hour)")
    args = p.parse_args(argv)
    base_nodes, base_stages = BASE_NODES, BASE_STAGES
    if args.quick:
        args.nodes, args.lifetimes, args.stages, args.hours = "64,128", "15m,2h", "4,8", 0.5
        base_nodes, base_stages = 128, 8
    print(f"simcurves: seed {args.seed}", file=sys.stderr)
    grid: list[tuple[str, Any, int, int, str]] = []
    grid += [("nodes", n, n, base_stages, BASE_LIFETIME) for n in (int(x) for x in args.nodes.split(","))]
    grid += [("mean_lifetime", lt, base_nodes, base_stages, lt) for lt in args.lifetimes.split(",")]
    grid += [("stages", s, base_nodes, s, BASE_LIFETIME) for s in (int(x) for x in args.stages.split(","))]
    done: dict[tuple[int, int, str], dict[str, Any]] = {}
    points = []
    for axis, value, nodes, stages, lifetime in grid:
        key = (nodes, stages, lifetime)
        if key not in done:  # the base point sits on every curve: run it once
            done[key] = _point(axis, value, nodes, stages, lifetime, args.hours, args.seed, args.point_timeout_s)
        points.append({**done[key], "axis": axis, "value": value})
    return {"seed": args.seed, "hours": args.hours, "base": {"nodes": base_nodes, "stages": base_stages, "mean_lifetime": BASE_LIFETIME},
            "points": points}
