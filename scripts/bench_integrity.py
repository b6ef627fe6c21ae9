"""Bench suite ``integrity``: do monitors and spot checks find and shut out a lying replica, and at what cost?

Every scenario is a real local swarm (a coordinator and 5 nodes as CLI subprocesses on 127.0.0.1, as
``protolearn demo`` runs it) on a tiny 2-stage run of 2 + 2 layers. Four nodes start together (two per
stage) and train; once all four have built their stage, the fifth, ``node4``, joins mid-run: the
coordinator puts it on the stage with less throughput per share, which then has 3 replicas. It syncs
its state from the others and, in an adversary run, attacks as ``--adversary KIND:FROM_STEP`` says
(node/adversary.py), as a newcomer on probation: on stage 0 it corrupts the activations it sends, on
stage 1 (the last) the gradients.

Per kind it reports whether the adversary was banned (``detected``), the microbatches it corrupted
before the ban (counted by the adversary itself: ``microbatches_to_ban``), whether an honest node was
banned (``false_positives``), and the final loss against the honest run's (``loss_ratio``; the goal
is within 3%). ``overhead``: the honest swarm's tokens/s with integrity checks off, against monitors
plus spot checks at p = 0.05, measured in the same invocation (the goal is ≤ 5% slower).

``--diloco H`` runs every scenario in DiLoCo mode (``[sync] mode = "diloco"``, ``inner_steps = H``, quorum 2,
grace 2 s; issue 24): spot checks then check the first inner step after each outer sync only, and the robust
rules act on pseudo-gradients; the report says so (``sync``).

Usage: ``python scripts/bench.py integrity --json [--kinds scale,nan] [--steps 14] [--quick] [--diloco 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from protolearn.node.adversary import ENV, KINDS

TINY = """
name = "integrity"
seed = {seed}
steps = {steps}
codec = "{codec}"
[model]
vocab_size = 259
d_model = 64
n_layers = 4
n_heads = 4
d_ff = 128
max_seq_len = 64
[stages]
num_stages = 2
layers = [2, 2]
[batch]
microbatches_per_step = 6
microbatch_size = 4
seq_len = 32
[optim]
warmup_steps = 2
total_steps = {steps}
[data]
max_bytes = 200000
[integrity]
monitors = {monitors}
spot_check_rate = {rate}
precisions = {precisions}
"""

DILOCO = """
[sync]
mode = "diloco"
inner_steps = {inner_steps}
quorum = 2
grace_s = 2.0
"""

NODES = 5
ADVERSARY = 4  # joins last, mid-run, as the third replica of a stage
START_S = 90.0


def _events(workdir: Path, k: int, event: str) -> list[dict]:
    path = workdir / f"node{k}" / "node.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if d.get("event") == event:
            out.append(d)
    return out


async def _watch(swarm, timeout_s: float, may_fail: set[int]):
    """Poll the coordinator's status until every node has exited (``may_fail`` may exit non-zero: the
    adversary, once banned); returns the last status. Raises if another node fails or time runs out."""
    import trio

    from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
    from protolearn.protocol.errors import ProtocolError
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host

    last = None
    with trio.fail_after(timeout_s):
        async with open_host(Identity.generate()) as host:
            link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))
            while True:
                for k, p in enumerate(swarm.nodes):
                    if k not in may_fail and p.poll() not in (None, 0):
                        raise RuntimeError(f"node{k} exited with code {p.returncode}: {swarm.tail(f'node{k}')}")
                done = swarm.nodes_done()
                try:
                    last = await link.status(loss_history=10_000)
                except ProtocolError:
                    pass
                if done:
                    return last
                await trio.sleep(0.5)


def run_config(*, steps: int, seed: int = 0, codec: str = "none", rate: float = 0.25, monitors: bool = True, bf16: bool = False) -> str:
    """The run config of a :func:`scenario` (its arguments of the same names)."""
    precisions = '["fp32", "bf16"]' if bf16 else '["fp32"]'
    return TINY.format(seed=seed, steps=steps, codec=codec, rate=rate, monitors=str(monitors).lower(), precisions=precisions)


def scenario(
    workdir: Path, *, kind: str | None = None, from_step: int = 0, steps: int = 30, seed: int = 0, codec: str = "none",
    rate: float = 0.25, monitors: bool = True, timeout_s: float = 300.0, bf16: bool = False, extra_toml: str = "",
) -> dict:
    """One swarm run; ``kind`` None is the honest run. See the module docstring for what it returns.

    ``bf16``: the run admits bf16 and a sixth node, ``node5``, joins with ``--bf16`` (CPU autocast) with
    ``node4``, as the third honest replica of a stage; it must never be banned."""
    import trio

    from protolearn.cli.demo import LocalSwarm

    run_toml = run_config(steps=steps, seed=seed, codec=codec, rate=rate, monitors=monitors, bf16=bf16) + extra_toml
    per_node = {ADVERSARY: ["--adversary", f"{kind}:{from_step}"]} if kind else {}
    if bf16:
        per_node[ADVERSARY + 1] = ["--bf16"]
    num_nodes = NODES + bf16
    os.environ[ENV] = "1"  # the adversary node needs it; an honest node ignores it
    swarm = LocalSwarm(workdir, run_toml, num_nodes, threads=1, per_node_args=per_node)
    t0 = time.monotonic()
    try:
        swarm.start_coordinator()
        deadline = time.monotonic() + START_S
        while not swarm.poll_address():
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.1)
        for _ in range(ADVERSARY):
            swarm.start_node()
        for k in range(ADVERSARY):
            while swarm.stage_of(k) is None:
                assert time.monotonic() < deadline and swarm.nodes[k].poll() is None, f"node{k} did not build a stage: {swarm.tail(f'node{k}')}"
                time.sleep(0.1)
        swarm.start_node()
        if bf16:
            # At once, not once the fifth node built its stage: on a loaded machine a node takes many steps to
            # start, and a bf16 node started that late joined after the last step. Whichever of the two joins
            # first goes to stage 0, the other to stage 1: either way it is one of its stage's 3 honest replicas.
            swarm.start_node()
        status = trio.run(_watch, swarm, timeout_s, {ADVERSARY} if kind else set())
    finally:
        swarm.stop()
    wall = time.monotonic() - t0
    stages = [swarm.stage_of(k) for k in range(num_nodes)]
    names = {}
    for k in range(num_nodes):
        started = _events(workdir, k, "start")
        if started:
            names[started[0]["peer_id"]] = f"node{k}"
    bans = {names.get(b.peer_id, b.peer_id): b.reason for b in (status.bans if status else [])}
    history = list(status.loss_history) if status is not None else []
    sent = _events(workdir, ADVERSARY, "adversary")
    closed = [h.closed_at for h in history]
    span = closed[-1] - closed[1] if len(closed) > 2 else float("nan")
    tokens_per_step = 6 * 4 * 32
    out = {
        "kind": kind or "honest", "stages": stages, "steps_closed": len(history), "final_loss": history[-1].loss if history else None,
        "bans": bans, "wall_s": round(wall, 1),
        "tokens_per_s": tokens_per_step * (len(closed) - 2) / span if len(closed) > 2 else 0.0,
        # From the median interval between step closes after the 5th: a step stalled by other load on a
        # shared machine does not count, nor the start-up while nodes join.
        "tokens_per_s_median": tokens_per_step / statistics.median(intervals) if (intervals := [b - a for a, b in zip(closed[5:], closed[6:])]) else 0.0,
        # The same over the last third of the steps (newcomers' probation has decayed towards p by then).
        "tokens_per_s_late": tokens_per_step / statistics.median(late) if (late := intervals[-len(intervals) // 3:]) else 0.0,
        "adversary_rc": swarm.nodes[ADVERSARY].returncode if kind else None,
        "adversary_said": swarm.tail(f"node{ADVERSARY}") if kind else None,
        "microbatches_to_ban": (sent[-1]["sent"] if sent else 0) if kind else None,
        # The step the adversary joined at (it starts once the honest four built their stages, and a node
        # takes seconds to start): a run that ends soon after gives it little to be caught on.
        "adversary_joined_step": next((e["step"] for e in _events(workdir, ADVERSARY, "joined")), None) if kind else None,
        "workdir": str(workdir),
    }
    if kind:
        out["detected"] = f"node{ADVERSARY}" in bans
        out["false_positives"] = sum(1 for n in bans if n != f"node{ADVERSARY}")
    else:
        out["false_positives"] = len(bans)
    return out


def _liveness(workdir: Path, kind: str, extra_toml: str = "") -> dict:
    """A liveness fault against the honest swarm in the same invocation (bench_blackhole.py): a blackhole
    among 3 stage-0 nodes, or a ``hang`` (its compute thread blocks for good from step 20) in a 2-stage
    swarm of three (two in stage 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("protolearn_bench_blackhole", Path(__file__).with_name("bench_blackhole.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    if kind == "hang":
        r = module.measure(quick=True, workdir=workdir, kind="hang", stages=2, num_nodes=3, from_step=20, extra_toml=extra_toml)
        return {
            **r, "detected": r["left_out_after_s"] is not None, "false_positives": len(r["honest_banned"]),
            "microbatches_to_ban": None, "throughput_ratio_after_ban": r["ratio"],
        }
    r = module.measure(quick=True, workdir=workdir, extra_toml=extra_toml)
    return {
        **r, "detected": bool(r["banned"]), "false_positives": len(r["honest_banned"]),
        "microbatches_to_ban": r["leases_until_ban"], "throughput_ratio_after_ban": r["ratio"],
    }


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py integrity")
    parser.add_argument("--kinds", default=",".join(KINDS), help="adversary kinds, comma-separated")
    parser.add_argument("--honest-seeds", type=int, default=1, help="honest runs with seeds 0..N-1 (the last one with the int8 codec when N > 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--from-step", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.25, help="spot-check rate p of the adversary runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-overhead", action="store_true", help="skip the overhead runs")
    parser.add_argument("--overhead-only", action="store_true", help="only the overhead runs")
    parser.add_argument("--overhead-steps", type=int, default=60, help="steps of each overhead run")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--diloco", type=int, default=0, metavar="H", help="run every scenario in DiLoCo mode with H inner steps")
    args = parser.parse_args(argv)
    extra = DILOCO.format(inner_steps=args.diloco) if args.diloco else ""
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-integrity-"))
    kinds = [k for k in args.kinds.split(",") if k] if not args.overhead_only else []
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"error: unknown adversary kinds {unknown}; choose from {', '.join(KINDS)}")
    if args.overhead_only:
        return {"overhead": _overhead(root, args.overhead_steps, args.seed), "workdir": str(root)}
    honest = scenario(root / "honest", steps=args.steps, seed=args.seed, rate=args.rate, extra_toml=extra)
    per_kind = {}
    for kind in kinds:
        if kind in ("blackhole", "hang"):  # liveness faults: measured by throughput, scripts/bench_blackhole.py
            per_kind[kind] = _liveness(root / kind, kind, extra)
            continue
        r = scenario(root / kind, kind=kind, from_step=args.from_step, steps=args.steps, seed=args.seed, rate=args.rate, extra_toml=extra)
        if r["final_loss"] and honest["final_loss"]:
            r["loss_ratio"] = r["final_loss"] / honest["final_loss"]
        per_kind[kind] = r
    honest_runs = [honest]
    for seed in range(1, args.honest_seeds):
        codec = "int8" if seed == args.honest_seeds - 1 else "none"
        honest_runs.append(scenario(root / f"honest-{seed}-{codec}", steps=args.steps, seed=seed, codec=codec, rate=args.rate, extra_toml=extra))
    out: dict = {
        "sync": f"diloco:{args.diloco}" if args.diloco else "step",
        "honest": honest,
        "kinds": per_kind,
        "detection_rate": {k: float(r["detected"]) for k, r in per_kind.items()},
        "false_positives": {k: r["false_positives"] for k, r in per_kind.items()} | {"honest": sum(h["false_positives"] for h in honest_runs)},
        "honest_runs": [{"seed": s, "workdir": h["workdir"], "bans": h["bans"], "final_loss": h["final_loss"]} for s, h in enumerate(honest_runs)],
        "max_microbatches_to_ban": {k: r["microbatches_to_ban"] for k, r in per_kind.items()},
    }
    if not args.no_overhead:
        out["overhead"] = _overhead(root, args.overhead_steps, args.seed)
    out["workdir"] = str(root)
    return out


def _overhead(root: Path, steps: int, seed: int) -> dict:
    """Honest swarms side by side, alternating: checks off (no monitors, no spot checks, probation
    included) and on (monitors + spot checks at p = 0.05, newcomers at 1.0 on probation), twice each."""
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for k, mode in enumerate(["off", "on", "off", "on"]):
        runs[mode].append(scenario(root / f"overhead-{k}-{mode}", steps=steps, seed=seed, rate=0.05 if mode == "on" else 0.0, monitors=mode == "on"))

    def cost(key: str) -> float | None:
        off, on = (statistics.mean(r[key] for r in runs[m]) for m in ("off", "on"))
        return 1.0 - on / off if off else None

    return {
        "tokens_per_s_off": [r["tokens_per_s_median"] for r in runs["off"]], "tokens_per_s_on": [r["tokens_per_s_median"] for r in runs["on"]],
        "overhead": cost("tokens_per_s_median"),
        "tokens_per_s_off_late": [r["tokens_per_s_late"] for r in runs["off"]], "tokens_per_s_on_late": [r["tokens_per_s_late"] for r in runs["on"]],
        "overhead_late": cost("tokens_per_s_late"), "steps": steps,
    }
