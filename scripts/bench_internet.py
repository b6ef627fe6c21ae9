"""Bench suite ``internet``: the swarm on home links against loopback (P11), and where a step's time goes.

``python scripts/bench.py internet --json [--codecs none,int8,subspace] [--steps 10] [--warmup 2] [--nodes 4] [--quick]``

The same local swarm (``--nodes`` processes over 2 stages, so each stage has replicas that average;
one torch thread each; the demo run) trains the same number of steps, so the same tokens, on loopback
and with every node on ``50mbit,40ms`` (the coordinator unshaped), for each codec: ``--repeats``
pairs of runs back to back in ABBA order (loopback first, then the link first, ...), so a drift in
the machine's load biases neither side. Reported per codec: mean tokens/s of each condition (from the
coordinator's step closes after ``--warmup`` steps), ``internet_efficiency`` = link ÷ loopback, each
pair's ratio, the final losses, and the compute and averaging seconds per step of each condition
(compute is the same work in both, so its spread shows how much the machine's load moved).
``best`` names the codec with the highest ``internet_efficiency``.

Then, for codec ``none``, where each step's time goes under loopback, ``50mbit,40ms`` and
``up=20mbit,down=100mbit,30ms``: every node logs a ``step_times`` event per step
(:mod:`protolearn.node.step_timing`: compute, transfer, bubble, averaging, commit, measured from the
node's own marks), averaged here over the timed steps and the nodes (and per stage), as seconds per
step and as shares of the step. The loopback and ``50mbit,40ms`` breakdowns pool the codec ``none``
runs above; the asymmetric one is one more run (``--asym-steps`` timed steps).

:func:`swarm_run` is shared with ``bench_pipeline.py`` and ``bench_linkrecovery.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LINK = "50mbit,40ms"
ASYM = "up=20mbit,down=100mbit,30ms"
PARTS = ("compute_s", "transfer_s", "bubble_s", "averaging_s", "commit_s", "other_s")


def swarm_run(
    workdir: Path, *, nodes: int, stages: int, steps: int, warmup: int, codec: str = "none", link: str | None = None,
    microbatches: int | None = None, threads: int = 1, config: Path | None = None,
) -> dict[str, Any]:
    """One local swarm (``config``, default the demo run) for ``warmup + steps`` steps; its throughput, losses and step breakdown."""
    import trio

    from protolearn.cli.demo import LocalSwarm, demo_run_toml
    from protolearn.stages.config import RunConfig

    total = warmup + steps
    run_toml = demo_run_toml(config, stages=stages, steps=total, codec=codec)
    if microbatches is not None:
        run_toml = RunConfig.from_toml_text(run_toml).replace(**{"batch.microbatches_per_step": microbatches}).to_toml()
    run = RunConfig.from_toml_text(run_toml)
    swarm = LocalSwarm(workdir, run_toml, nodes, threads=threads, node_args=["--link", link] if link else [])
    t0 = time.monotonic()
    failed: dict[int, str] = {}
    try:
        swarm.start_coordinator()
        status = trio.run(_watch, swarm, failed)
    finally:
        swarm.stop()
    history = list(status.loss_history) if status is not None else []
    if len(history) < total:
        raise SystemExit(f"error: the swarm closed {len(history)} of {total} steps; logs in {workdir}")
    first = history[warmup - 1] if warmup else history[0]
    timed = steps if warmup else steps - 1
    span = history[-1].closed_at - first.closed_at
    return {
        "codec": codec, "link": link, "nodes": nodes, "stages": stages, "microbatches": run.batch.microbatches_per_step,
        "tokens_per_step": run.batch.tokens_per_step, "steps": steps, "warmup": warmup,
        "tokens_per_s": run.batch.tokens_per_step * timed / span, "s_per_step": span / timed,
        "final_loss": history[-1].loss, "losses": [h.loss for h in history], "wall_s": round(time.monotonic() - t0, 1),
        "breakdown": breakdown(workdir, warmup), "nodes_failed": {f"node{k}": why for k, why in failed.items()}, "workdir": str(workdir),
    }


async def _watch(swarm: Any, failed: dict[int, str], timeout_s: float = 4 * 3600) -> Any:
    """Start the nodes and follow the run until every node has exited; the last status seen.

    Unlike the demo's watch, a node that exits with an error is recorded in ``failed`` (with the last line
    it wrote) and the run goes on: on a slow link a replica that falls behind may give up near the end,
    which is a finding of the benchmark, not a reason to lose the run's measurements.
    """
    import trio

    from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
    from protolearn.protocol.errors import ProtocolError
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host

    with trio.fail_after(timeout_s):
        while not swarm.poll_address():
            await trio.sleep(0.1)
        swarm.start_nodes()
        last = None
        async with open_host(Identity.generate()) as host:
            link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))
            while True:
                for k, p in enumerate(swarm.nodes):
                    if k not in failed and p.poll() not in (None, 0):
                        failed[k] = swarm.tail(f"node{k}")
                try:
                    last = await link.status(loss_history=10_000)
                except ProtocolError:
                    pass
                if swarm.nodes_done():
                    return last
                await trio.sleep(0.5)


def breakdown(workdirs: Path | list[Path], warmup: int) -> dict[str, Any]:
    """The nodes' ``step_times`` of the timed steps (of one run, or several runs pooled): mean seconds per
    step per part, overall and per stage."""
    per_node: list[tuple[int, dict[str, float]]] = []
    logs = [log for w in ([workdirs] if isinstance(workdirs, Path) else workdirs) for log in sorted(w.glob("node*/node.jsonl"))]
    for log in logs:
        events = [json.loads(line) for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
        built = [e["stage"] for e in events if e.get("event") == "built"]
        times = [e for e in events if e.get("event") == "step_times" and e["step"] >= warmup]
        resyncs = sum(1 for e in events if e.get("event") == "resync" and e.get("reason") and e.get("step", 0) >= warmup)
        if built and times:
            row = {k: statistics.mean(e[k] for e in times) for k in (*PARTS, "wall_s", "apply_s", "transfer_busy_s")}
            per_node.append((built[-1], {**row, "resyncs": resyncs}))

    def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
        mean = {k: round(statistics.mean(r[k] for r in rows), 4) for k in rows[0] if k != "resyncs"}
        total = sum(mean[k] for k in PARTS)
        return {"seconds": mean, "shares": {k: round(mean[k] / total, 4) if total else 0.0 for k in PARTS}, "nodes": len(rows),
                "resyncs": sum(int(r["resyncs"]) for r in rows)}

    if not per_node:
        return {}
    out = summary([r for _, r in per_node])
    out["by_stage"] = {str(s): summary([r for st, r in per_node if st == s]) for s in sorted({st for st, _ in per_node})}
    return out


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py internet", description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="none,int8,subspace")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs per codec, in ABBA order (loopback first, then link first, ...)")
    parser.add_argument("--quick", action="store_true", help="codec none only, one pair, 3 timed steps after 1")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the asymmetric run")
    parser.add_argument("--asym-steps", type=int, default=4, help="timed steps of the asymmetric run (its steps are slow)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    codecs = ["none"] if args.quick else [c for c in args.codecs.split(",") if c]
    steps, warmup, repeats = (3, 1, 1) if args.quick else (args.steps, args.warmup, max(1, args.repeats))
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-internet-"))
    t0 = time.monotonic()
    common = {"nodes": args.nodes, "stages": 2, "steps": steps, "warmup": warmup}
    p11: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for codec in codecs:
        for rep in range(repeats):
            # ABBA: the machine's load drifts, so each condition goes first in every other pair.
            order = ("loopback", LINK) if rep % 2 == 0 else (LINK, "loopback")
            for cond in order:
                r = swarm_run(root / f"{codec}-{'link' if cond == LINK else cond}-{rep}", codec=codec, link=None if cond == "loopback" else LINK, **common)
                runs.setdefault(f"{codec}/{cond}", []).append(r)
        loop, shaped = runs[f"{codec}/loopback"], runs[f"{codec}/{LINK}"]
        lb, kb = breakdown([Path(r["workdir"]) for r in loop], warmup), breakdown([Path(r["workdir"]) for r in shaped], warmup)
        loop_tps, link_tps = statistics.mean(r["tokens_per_s"] for r in loop), statistics.mean(r["tokens_per_s"] for r in shaped)
        p11[codec] = {
            "loopback_tokens_per_s": round(loop_tps, 1), "link_tokens_per_s": round(link_tps, 1),
            "internet_efficiency": round(link_tps / loop_tps, 4),
            "pair_ratios": [round(k["tokens_per_s"] / lo["tokens_per_s"], 4) for lo, k in zip(loop, shaped, strict=True)],
            "loopback_final_loss": loop[-1]["final_loss"], "link_final_loss": shaped[-1]["final_loss"],
            "final_losses": {"loopback": [r["final_loss"] for r in loop], LINK: [r["final_loss"] for r in shaped]},
            "loopback_s_per_step": round(statistics.mean(r["s_per_step"] for r in loop), 3),
            "link_s_per_step": round(statistics.mean(r["s_per_step"] for r in shaped), 3),
            "loopback_compute_s": get_s(lb, "compute_s"), "link_compute_s": get_s(kb, "compute_s"),
            "loopback_averaging_s": get_s(lb, "averaging_s"), "link_averaging_s": get_s(kb, "averaging_s"),
        }
    best = max(p11, key=lambda c: p11[c]["internet_efficiency"])
    out: dict[str, Any] = {
        "link": LINK, **common, "repeats": repeats, "tokens": steps * runs[f"{best}/loopback"][0]["tokens_per_step"], "p11": p11, "best": best,
        "internet_efficiency": p11[best]["internet_efficiency"],
    }
    if "none" in codecs:
        conditions = {"loopback": runs["none/loopback"], LINK: runs[f"none/{LINK}"]}
        if not args.no_breakdown:
            conditions[ASYM] = [swarm_run(root / "none-asym", link=ASYM, **{**common, "steps": min(steps, args.asym_steps)})]
        out["breakdown"] = {
            name: {**breakdown([Path(r["workdir"]) for r in rs], warmup), "s_per_step": round(statistics.mean(r["s_per_step"] for r in rs), 4),
                   "steps": sum(r["steps"] for r in rs), "runs": len(rs), "nodes_failed": {k: v for r in rs for k, v in r["nodes_failed"].items()}}
            for name, rs in conditions.items()
        }
        out["averaging_share_50mbit_40ms"] = out["breakdown"][LINK]["shares"]["averaging_s"]
    out["runs"] = {k: [{kk: v for kk, v in r.items() if kk != "breakdown"} for r in rs] for k, rs in runs.items()}
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["workdir"] = str(root)
    return out


def get_s(bd: dict[str, Any], key: str) -> float | None:
    return bd.get("seconds", {}).get(key)
