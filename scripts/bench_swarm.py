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
    from protolearn.stages.config import RunConfig

    from protolearn.cli.demo import LocalSwarm, demo_run_toml, watch

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


def recovery_keys(config: str | None = None, *, steps: int = 24, warmup: int = 4, threads: int = 1, workdir: Path | None = None) -> dict:
    """``recover_s`` and ``join_to_first_microbatch_s`` on a local swarm of 3 nodes over 2 stages.

    After ``warmup`` steps, one replica of a stage that has two is SIGKILLed. ``recover_s`` runs from the
    kill until a step closes at a rate of at least (n-1)/n of the rate before the kill (n = 3 nodes),
    rates taken from when this process saw consecutive steps close. The victim is then restarted on
    its data dir; ``join_to_first_microbatch_s`` runs from the coordinator accepting its join (its
    ``joined`` event) to the first microbatch it processed, and ``start_to_first_microbatch_s`` from
    the process launch (Python and torch start-up included). ``scripts/bench_recovery.py`` calls this.
    """
    import trio

    from protolearn.cli.demo import LocalSwarm, demo_run_toml

    workdir = workdir or Path(tempfile.mkdtemp(prefix="protolearn-bench-recovery-"))
    run_toml = demo_run_toml(Path(config) if config else None, stages=2, steps=steps, codec="none")
    n = 3
    swarm = LocalSwarm(workdir, run_toml, n, threads=threads)
    out: dict = {"recovery_nodes": n, "recovery_workdir": str(workdir)}

    def events(k: int, name: str) -> list[dict]:
        path = workdir / f"node{k}" / "node.jsonl"
        if not path.exists():
            return []
        found = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by the SIGKILL
            if d.get("event") == name:
                found.append(d)
        return found

    async def main() -> None:
        from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
        from protolearn.protocol.errors import ProtocolError
        from protolearn.protocol.identity import Identity
        from protolearn.protocol.transport import open_host

        with trio.fail_after(120):
            while not swarm.poll_address():
                await trio.sleep(0.1)
        swarm.start_nodes()
        seen: list[float] = []  # monotonic time this process first saw step i closed
        async with open_host(Identity.generate()) as host:
            link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))

            async def poll() -> None:
                try:
                    status = await link.status(loss_history=10_000)
                except ProtocolError:
                    return
                while len(seen) < len(status.loss_history):
                    seen.append(time.monotonic())
                if swarm.failed_node():
                    raise SystemExit(f"error: {swarm.failed_node()}")

            with trio.fail_after(600):
                while len(seen) < warmup:
                    await poll()
                    await trio.sleep(0.05)
                before = (seen[-1] - seen[1]) / (len(seen) - 2)  # s per step, the first (start-up) step left out
                stages = {k: swarm.stage_of(k) for k in range(n)}
                victim = next(k for k in range(n) if sum(1 for v in stages.values() if v == stages[k]) >= 2)
                out["recovery_victim_stage"] = stages[victim]
                killed_at_step = len(seen)
                t_kill = time.monotonic()
                await trio.to_thread.run_sync(swarm.kill_node, victim)
                while "recover_s" not in out:
                    await poll()
                    for i in range(max(killed_at_step, 1), len(seen)):
                        # The step's full interval: one that held the kill and still closed at speed lost nothing.
                        if seen[i] - seen[i - 1] <= before * n / (n - 1):
                            out["recover_s"] = seen[i] - t_kill
                            break
                    await trio.sleep(0.05)
                out["s_per_step_before_kill"] = before
                t_launch = time.time()
                swarm.restart_node(victim)
                while True:
                    joined = [d for d in events(victim, "joined") if d["t"] >= t_launch]
                    first = [d for d in events(victim, "first_microbatch") if d["at"] >= t_launch]
                    if joined and first:
                        out["join_to_first_microbatch_s"] = first[0]["at"] - joined[-1]["t"]
                        out["start_to_first_microbatch_s"] = first[0]["at"] - t_launch
                        return
                    await poll()
                    await trio.sleep(0.1)

    try:
        swarm.start_coordinator()
        trio.run(main)
    finally:
        swarm.stop()
    return out
