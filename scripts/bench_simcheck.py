"""Bench suite ``simcheck``: the simulator against a real local swarm on the same small scenario (issue 26).

``python scripts/bench.py simcheck --json [--steps 30] [--link SPEC] [--crash-after 8] [--join-after 16] [--seed 0]``

**The real swarm.** A coordinator and 6 ``node join`` processes (the demo run in 3 stages, codec ``none``, one
torch thread each, every node on the emulated ``--link``, default ``up=20mbit,down=100mbit,20ms``) train
``--steps`` steps. Once ``--crash-after`` steps have closed, one replica (the first node of a stage with two)
is SIGKILLed; once ``--join-after`` have closed, a fresh node (a new identity) joins.

**The simulated swarm.** ``scripts/simulate.py`` on ``scripts/scenarios/demo.toml`` with the same run, nodes,
stages and link (one link for all, no spread of compute), and a churn trace of the real run's events on
its clock: the six joins when the real nodes joined, the crash and the join when they happened. The
simulated nodes' compute speed is calibrated from the real run: the FLOPs of the microbatches the real
nodes processed (the simulator's own cost model, :mod:`protolearn.sim.costs`) over the compute seconds
their ``step_times`` events measured; the simulation runs as long as the real swarm trained.

**Compared** (each side's figure, and sim ÷ real; the goal is within 20%, or the difference explained):

- ``step_s``: the median seconds between step closes (real: the coordinator's close times; sim: between
  commits once training runs);
- ``goodput``: the share of the work that ended up in a committed step, as the simulator counts it
  (:mod:`protolearn.sim.metrics`). Real: compute on the tickets the committed accounting credits (each
  stage's seconds per microbatch, from steps trained in one round, times the credited tickets) plus the
  averaging seconds, over all compute and averaging plus the joiner's state download (join to synced). A
  replica's averaging that a reopen superseded is counted as useful on the real side (the node's
  ``step_times`` sum a step's rounds);
- ``bytes_per_token``: what the nodes sent per committed token. Real: the emulated links' upstream bytes
  (each node logs them when it finishes; the killed node's are missing) over committed tokens; sim: the
  boundary bytes of both directions at every boundary plus the replica sync bytes, per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINK = "up=20mbit,down=100mbit,20ms"
NODES, STAGES = 6, 3
WARMUP = 2  # steps left out of the real run's per-microbatch compute (start-up, first compile)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut off by the SIGKILL
    return out


def real_run(workdir: Path, *, steps: int, link: str, crash_after: int, join_after: int) -> dict[str, Any]:
    """The real swarm: its close times, the crash and join times (wall clock), and its nodes' event logs."""
    import trio

    from protolearn.cli.demo import LocalSwarm, demo_run_toml

    run_toml = demo_run_toml(None, stages=STAGES, steps=steps, codec="none")
    swarm = LocalSwarm(workdir, run_toml, NODES, threads=1, node_args=["--link", link])
    out: dict[str, Any] = {"workdir": str(workdir), "run_toml": run_toml}

    async def main() -> Any:
        from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
        from protolearn.protocol.errors import ProtocolError
        from protolearn.protocol.identity import Identity
        from protolearn.protocol.transport import open_host

        with trio.fail_after(120):
            while not swarm.poll_address():
                await trio.sleep(0.1)
        out["nodes_started_at"] = time.time()
        swarm.start_nodes()
        last = None
        async with open_host(Identity.generate()) as host:
            link_ = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))
            with trio.fail_after(1800):
                while True:
                    try:
                        last = await link_.status(loss_history=10_000)
                    except ProtocolError:
                        await trio.sleep(0.2)
                        continue
                    closed = len(last.loss_history)
                    if "crash_at" not in out and closed >= crash_after:
                        stages = {k: swarm.stage_of(k) for k in range(NODES)}
                        victim = next(k for k in range(NODES) if sum(1 for v in stages.values() if v == stages[k]) >= 2)
                        out.update(crash_at=time.time(), victim=f"node{victim}", victim_stage=stages[victim])
                        await trio.to_thread.run_sync(swarm.kill_node, victim)
                    if "join_at" not in out and closed >= join_after:
                        out["join_at"] = time.time()
                        swarm.start_node()  # node6: a fresh identity and data dir
                    if swarm.failed_node():
                        raise SystemExit(f"error: {swarm.failed_node()}; logs in {workdir}")
                    if closed >= steps and swarm.nodes_done():
                        return last
                    await trio.sleep(0.1)

    try:
        swarm.start_coordinator()
        status = trio.run(main)
    finally:
        swarm.stop()
    out["closes"] = [h.closed_at for h in status.loss_history]
    out["logs"] = {p.parent.name: _events(p) for p in sorted(workdir.glob("node*/node.jsonl"))}
    return out


def state_download_s(logs: list[dict[str, Any]]) -> float:
    """A node's seconds spent taking its stage's state: each ``synced`` from the ``joined``, ``moved`` or ``resync``
    that began it (a node that moved to another stage downloads again)."""
    total, since = 0.0, None
    for e in logs:
        if e["event"] in ("joined", "moved", "resync"):
            since = e["t"]
        elif e["event"] == "synced" and since is not None:
            total += e["t"] - since
            since = None
    return total


def real_figures(real: dict[str, Any]) -> dict[str, Any]:
    """The real run's step time, goodput and bytes per token (as the module docstring says), and the compute
    speed the simulation is calibrated with."""
    from protolearn.sim.costs import RunCosts
    from protolearn.stages.config import RunConfig

    run = RunConfig.from_toml_text(real["run_toml"])
    costs = RunCosts.of(run)
    closes = real["closes"]
    gaps = [b - a for a, b in zip(closes, closes[1:], strict=False)]
    flops = compute = 0.0
    per_mb: dict[int, list[float]] = {}
    all_compute = averaging = download = 0.0
    up_bytes = 0
    credited: list[tuple[int, int]] = []  # (stage, tickets) per node-step
    for logs in real["logs"].values():
        built = [e["stage"] for e in logs if e["event"] == "built"]
        if not built:
            continue
        stage = built[-1]
        sc = costs.stages[stage]
        steps = {e["step"]: e for e in logs if e["event"] == "step"}
        for t in (e for e in logs if e["event"] == "step_times"):
            work = max(0.0, t["compute_s"] - t["apply_s"])
            all_compute += work
            averaging += t["averaging_s"]
            s = steps.get(t["step"])
            n = len(s["tickets"]) if s else 0
            credited.append((stage, n))
            if t["step"] >= WARMUP and t["rounds"] == 1 and n:
                per_mb.setdefault(stage, []).append(work / n)
                flops += n * (sc.fwd_flops + sc.bwd_flops)
                compute += work
        download += state_download_s(logs)
        for e in logs:
            if e["event"] == "link":
                up_bytes += int(e.get("up", {}).get("bytes", 0))
    mb_s = {s: statistics.median(v) for s, v in per_mb.items()}
    useful_compute = sum(n * mb_s.get(stage, 0.0) for stage, n in credited)
    useful = min(useful_compute, all_compute) + averaging
    tokens = run.batch.tokens_per_step * len(closes)
    return {
        "steps": len(closes),
        "step_s": statistics.median(gaps[WARMUP:]) if len(gaps) > WARMUP else None,
        "tokens_per_s": run.batch.tokens_per_step * (len(closes) - 1) / (closes[-1] - closes[0]) if len(closes) > 1 else None,
        "goodput": useful / (all_compute + averaging + download) if all_compute + averaging + download > 0 else None,
        "compute_s": round(all_compute, 3), "useful_compute_s": round(useful_compute, 3), "averaging_s": round(averaging, 3),
        "state_download_s": round(download, 3), "s_per_microbatch": {str(k): round(v, 4) for k, v in sorted(mb_s.items())},
        "bytes_per_token": up_bytes / tokens if up_bytes and tokens else None,
        "calibrated_tflops": flops / compute / 1e12 if compute else None,
    }


def sim_run(real: dict[str, Any], tflops: float, link: str, seed: int, workdir: Path) -> dict[str, Any]:
    """The simulation of the real run: its joins, crash and join on a trace, at the calibrated compute speed."""
    t0 = real["nodes_started_at"]
    rows = []
    for name, logs in real["logs"].items():
        joined = [e["t"] for e in logs if e["event"] == "joined"]
        if joined:
            rows.append((joined[0] - t0, "join", name))
    rows.append((real["crash_at"] - t0, "crash", real["victim"]))
    trace = workdir / "trace.csv"
    trace.write_text("".join(f"{when:.3f},{event},{label}\n" for when, event, label in sorted(rows)))
    end = real["closes"][-1] - t0 + 1.0
    args = ["--scenario", str(ROOT / "scripts" / "scenarios" / "demo.toml"), "--nodes", str(NODES), "--stages", str(STAGES),
            "--hours", f"{end / 3600:.6f}", "--seed", str(seed),
            "--set", f"hardware.tflops={tflops:.6g}", "--set", "hardware.tflops_sigma=0",
            "--set", "hardware.links=" + json.dumps([{"spec": link, "weight": 1}]), "--set", f"churn.trace={trace}", "--json"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate.py"), *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"error: the simulation failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    tokens_bytes = sum(r["boundary_bytes_per_token"]) + (r["sync_bytes_per_token"] or 0.0)
    return {"command": "python scripts/simulate.py " + " ".join(args), "trace": trace.read_text().splitlines(),
            "steps": r["steps"], "step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"], "goodput": r["goodput"],
            "lost": r["lost"], "bytes_per_token": tokens_bytes, "boundary_bytes_per_token": r["boundary_bytes_per_token"],
            "sync_bytes_per_token": r["sync_bytes_per_token"], "useful_compute_s": r["useful_compute_s"],
            "useful_avg_s": r["useful_avg_s"], "sync_s": r["sync_s"]}


def run(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.py simcheck", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--link", default=LINK, help=f"every node's emulated link (default {LINK})")
    p.add_argument("--crash-after", type=int, default=8, help="steps closed before a replica is SIGKILLed")
    p.add_argument("--join-after", type=int, default=16, help="steps closed before a fresh node joins")
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    if not 0 < args.crash_after < args.join_after < args.steps:
        p.error(f"need 0 < --crash-after ({args.crash_after}) < --join-after ({args.join_after}) < --steps ({args.steps})")
    from protolearn.protocol.link import parse_link
    from protolearn.errors import ConfigError

    try:
        parse_link(args.link)
    except ConfigError as err:
        p.error(f"--link: {err}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-simcheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    real = real_run(workdir / "real", steps=args.steps, link=args.link, crash_after=args.crash_after, join_after=args.join_after)
    rf = real_figures(real)
    sim = sim_run(real, rf["calibrated_tflops"], args.link, args.seed, workdir)
    ratio = {k: (sim[k] / rf[k] if sim.get(k) and rf.get(k) else None) for k in ("step_s", "goodput", "bytes_per_token", "tokens_per_s")}
    return {
        "suite": "simcheck", "nodes": NODES, "stages": STAGES, "link": args.link, "steps": args.steps,
        "crash_after": args.crash_after, "join_after": args.join_after, "victim_stage": real["victim_stage"],
        "real": rf, "sim": sim, "sim_over_real": ratio,
        "within_20pct": {k: (v is not None and abs(v - 1) <= 0.2) for k, v in ratio.items() if k != "tokens_per_s"},
        "workdir": str(workdir), "wall_s": round(time.monotonic() - t0, 1),
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
