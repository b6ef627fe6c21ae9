"""Bench suite ``swarm``: a local swarm's training throughput against the reference trainer's.

One invocation measures both on the same run (default: the demo run) and machine:

- ``swarm_tokens_per_s``: a coordinator plus one node per stage (S=2, one replica each, codec none),
  started through the CLI like ``protolearn demo``. Timed from the close of the first ``--warmup``
  steps to the close of the last one, as the coordinator recorded them, so start-up is excluded.
- ``reference_tokens_per_s``: ``scripts/bench_reference.py`` in a subprocess (all cores, the same
  warm-up), so both sides own the machine alike; run before and after the swarm, and averaged.
- ``ratio`` = swarm / reference; the goal is >= 0.90 on 2 cores.

The node logs give the per-step averaging time, reported as ``averaging_s_mean``, which with
``s_per_step`` shows where the swarm's time goes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reference(config: str | None, steps: int, warmup: int) -> dict:
    argv = [sys.executable, str(ROOT / "scripts" / "bench.py"), "reference", "--json", "--steps", str(steps), "--warmup", str(warmup)]
    if config:
        argv += ["--config", config]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _swarm(config: str | None, stages: int, steps: int, warmup: int, threads: int, workdir: Path) -> dict:
    import trio

    from protolearn.cli.demo import LocalSwarm, demo_run_toml, watch
    from protolearn.stages.config import RunConfig

    total = steps + warmup
    run_toml = demo_run_toml(Path(config) if config else None, stages=stages, steps=total, codec="none")
    run = RunConfig.from_toml_text(run_toml)
    swarm = LocalSwarm(workdir, run_toml, stages, threads=threads)
    t0 = time.monotonic()
    try:
        swarm.start_coordinator()
        status = trio.run(watch, swarm, None, 0.5)
    finally:
        swarm.stop()
    wall = time.monotonic() - t0
    history = list(status.loss_history) if status is not None else []
    if len(history) < total:
        raise SystemExit(f"error: the swarm closed {len(history)} of {total} steps; logs in {workdir}")
    # Step `warmup - 1` closing starts the clock: `steps` steps follow it.
    span = history[-1].closed_at - history[warmup - 1].closed_at if warmup else history[-1].closed_at - history[0].closed_at
    timed = steps if warmup else steps - 1
    averaging = []
    for log in workdir.glob("node*/node.jsonl"):
        for line in log.read_text().splitlines():
            d = json.loads(line)
            if d["event"] == "step" and d["step"] >= warmup:
                averaging.append(d["averaging_s"])
    return {
        "swarm_tokens_per_s": run.batch.tokens_per_step * timed / span,
        "swarm_s_per_step": span / timed,
        "swarm_wall_s": wall,
        "swarm_last_loss": history[-1].loss,
        "averaging_s_mean": sum(averaging) / len(averaging) if averaging else 0.0,
    }


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py swarm")
    parser.add_argument("--config", default=None, help="run config TOML (default: the demo run)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages, one node each")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--workdir", default=None, help="logs of the swarm (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-swarm-"))

    # The reference runs before and after the swarm, so a change in machine load (2 shared cores) during
    # the invocation biases neither side; its mean is the denominator.
    before = _reference(args.config, args.steps, args.warmup)
    swarm = _swarm(args.config, args.stages, args.steps, args.warmup, args.threads, workdir)
    after = _reference(args.config, args.steps, args.warmup)
    ref_tps = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    return {
        **swarm,
        "reference_tokens_per_s": ref_tps,
        "reference_tokens_per_s_before_after": [before["tokens_per_s"], after["tokens_per_s"]],
        "reference_s_per_step": (before["s_per_step"] + after["s_per_step"]) / 2,
        "ratio": swarm["swarm_tokens_per_s"] / ref_tps,
        "stages": args.stages,
        "threads_per_node": args.threads,
        "reference_threads": before["threads"],
        "steps": args.steps,
        "workdir": str(workdir),
    }
