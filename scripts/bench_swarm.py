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
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reference(config: str | None, steps: int, warmup: int, threads: int | None = None) -> dict:
    argv = [sys.executable, str(ROOT / "scripts" / "bench.py"), "reference", "--json", "--steps", str(steps), "--warmup", str(warmup)]
    if config:
        argv += ["--config", config]
    if threads:
        argv += ["--threads", str(threads)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _swarm(config: str | None, stages: int, steps: int, warmup: int, threads: int, workdir: Path) -> dict:
    spec = importlib.util.spec_from_file_location("protolearn_bench_internet", ROOT / "scripts" / "bench_internet.py")
    assert spec is not None and spec.loader is not None
    internet = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = internet
    spec.loader.exec_module(internet)
    r = internet.swarm_run(workdir, nodes=stages, stages=stages, steps=steps, warmup=warmup, threads=threads, config=Path(config) if config else None)
    averaging = []
    for log in workdir.glob("node*/node.jsonl"):
        for line in log.read_text().splitlines():
            d = json.loads(line)
            if d["event"] == "step" and d["step"] >= warmup:
                averaging.append(d["averaging_s"])
    return {
        "swarm_tokens_per_s": r["tokens_per_s"],
        "swarm_s_per_step": r["s_per_step"],
        "swarm_wall_s": r["wall_s"],
        "swarm_last_loss": r["final_loss"],
        "averaging_s_mean": sum(averaging) / len(averaging) if averaging else 0.0,
        "breakdown": r["breakdown"],
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


def recovery_keys(
    config: str | None = None, *, steps: int = 24, warmup: int = 4, threads: int = 1, workdir: Path | None = None, node_args: list[str] | None = None,
    kill_phase: float = 0.0,
) -> dict:
    """``recover_s`` and ``join_to_first_microbatch_s`` on a local swarm of 3 nodes over 2 stages.

    After ``warmup`` steps, one replica of a stage that has two is SIGKILLed. ``recover_s`` runs from the
    kill until steps close at a rate of at least (n-1)/n of the rate before the kill (n = 3 nodes): to the
    first close after the kill from which the next step takes at most n/(n-1) of a step before, times taken
    from the coordinator's close times. A step that the kill reopened counts at its close after the kill (its
    redo), and only committed steps count. ``recover_first_close_s`` is the measure this replaced: to the first
    step closed after the kill that itself took at most n/(n-1) of a step, as this process first saw each
    close (a reopened step's second close unseen). The victim is then restarted on
    its data dir; ``join_to_first_microbatch_s`` runs from the coordinator accepting its join (its
    ``joined`` event) to the first microbatch it processed, and ``start_to_first_microbatch_s`` from
    the process launch (Python and torch start-up included); ``kill_to_next_close_s`` from the kill to
    the next step that closed. ``node_args`` go to every node (``bench_linkrecovery.py`` gives them a
    ``--link``). ``kill_phase`` puts the kill that fraction of a step (the rate before) after the close that
    ends the warm-up: 0 kills as soon as the close is seen, mostly while the replicas average that step.
    ``scripts/bench_recovery.py`` calls this.
    """
    import trio

    from protolearn.cli.demo import LocalSwarm, demo_run_toml

    workdir = workdir or Path(tempfile.mkdtemp(prefix="protolearn-bench-recovery-"))
    run_toml = demo_run_toml(Path(config) if config else None, stages=2, steps=steps, codec="none")
    n = 3
    swarm = LocalSwarm(workdir, run_toml, n, threads=threads, node_args=list(node_args or []))
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
        # step -> when the coordinator closed it (its wall clock, this machine's): a step that the kill reopened
        # closes again, and its point in the history then carries the new time. Only committed steps are read, so
        # a close that is later undone never counts.
        closes: dict[int, float] = {}
        committed = [-1]
        seen: dict[int, float] = {}  # step -> when this process first saw it closed, for recover_first_close_s
        async with open_host(Identity.generate()) as host:
            link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))

            async def poll() -> None:
                try:
                    status = await link.status(loss_history=10_000)
                except ProtocolError:
                    return
                closes.update({p.step: p.closed_at for p in status.loss_history})
                for p in status.loss_history:
                    seen.setdefault(p.step, time.time())
                committed[0] = status.last_committed
                if swarm.failed_node():
                    raise SystemExit(f"error: {swarm.failed_node()}")

            def final() -> list[int]:
                return sorted(i for i in closes if i <= committed[0])

            with trio.fail_after(600):
                while len(closes) < warmup:
                    await poll()
                    await trio.sleep(0.05)
                done = sorted(closes)
                before = (closes[done[-1]] - closes[done[1]]) / (len(done) - 2)  # s per step, the first (start-up) step left out
                stages = {k: swarm.stage_of(k) for k in range(n)}
                victim = next(k for k in range(n) if sum(1 for v in stages.values() if v == stages[k]) >= 2)
                out["recovery_victim_stage"] = stages[victim]
                out["kill_phase"] = kill_phase
                if kill_phase > 0:
                    await trio.sleep(max(0.0, closes[max(closes)] + kill_phase * before - time.time()))
                    await poll()
                t_kill = time.time()
                out["kill_at"] = t_kill  # wall clock, to line up with the nodes' event logs
                seen_at_kill = set(seen)
                await trio.to_thread.run_sync(swarm.kill_node, victim)
                while "recover_s" not in out or "recover_first_close_s" not in out:
                    await poll()
                    # The measure before reopened steps counted (issue 28's figures to 2026-12-06): a step's first
                    # close as this process saw it, the steps seen closed before the kill left out.
                    for i in sorted(set(seen) - seen_at_kill):
                        if "recover_first_close_s" not in out and i - 1 in seen and seen[i] - seen[i - 1] <= before * n / (n - 1):
                            out["recover_first_close_s"] = seen[i] - t_kill
                    after = [i for i in final() if closes[i] > t_kill]
                    if after and "kill_to_next_close_s" not in out:
                        out["kill_to_next_close_s"] = closes[after[0]] - t_kill
                    for i in after:
                        # Back at speed: the step after this close took at most n/(n-1) of a step before the kill.
                        if "recover_s" not in out and i + 1 in after and closes[i + 1] - closes[i] <= before * n / (n - 1):
                            out["recover_s"] = closes[i] - t_kill
                    if committed[0] >= steps - 1:
                        # The run ended (a loaded machine) before a measure held, or with no step left for the restarted
                        # victim to join: say so, rather than wait out the deadline.
                        missing = [k for k in ("recover_s", "recover_first_close_s") if k not in out]
                        what = f"{', '.join(missing)} held" if missing else "the victim could rejoin"
                        raise SystemExit(f"error: the run's {steps} steps closed before {what}; rerun it on a quieter machine")
                    await trio.sleep(0.05)
                out["s_per_step_before_kill"] = before
                t_launch = time.time()
                swarm.restart_node(victim)
                while True:
                    joined = [d for d in events(victim, "joined") if d["t"] >= t_launch]
                    first = [d for d in events(victim, "first_microbatch") if d["at"] >= t_launch]
                    if joined and first:
                        built = [d for d in events(victim, "built") if d["t"] >= t_launch]
                        synced = [d for d in events(victim, "synced") if d["t"] >= t_launch]
                        out["victim_params"] = built[0]["params"] if built else None
                        out["join_to_synced_s"] = synced[0]["t"] - joined[-1]["t"] if synced else None
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
