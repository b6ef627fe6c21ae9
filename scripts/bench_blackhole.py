"""Bench ``blackhole`` (issue 11) and ``hang`` (issue 28): a swarm's throughput with one node that accepts
work and never delivers, or whose compute thread blocks for good while its network stays up.

:func:`measure` runs the same local swarm twice on the same machine, one run after the other: honest
(``num_nodes`` nodes), then with node 0 started as ``--adversary blackhole:FROM_STEP``. Each is a
coordinator and nodes started through the CLI, as ``protolearn demo`` does, with a short ``--lease-s``
so that a quick run fits in a minute. Times are the coordinator's step-close times (its loss history), so
start-up is excluded:

- ``honest_tokens_per_s``: steps after ``warmup`` of the honest run;
- ``blackhole_tokens_per_s``: steps that closed after the blackhole was banned (after its 20th lease
  if it never was);
- ``ratio`` = blackhole / honest (the goal is >= 0.9). These three come from the median interval
  between step closes (a step stalled by other load on a shared machine does not count); the
  ``*_mean`` keys are the plain span means;
- ``leases_until_ban``: the leases it sat on until the ban (from the ban reason), and
  ``steps_until_ban``: steps closed from its first blackholed step (``blackhole_from_step``: FROM_STEP,
  or the step it joined at when a loaded machine started it later) to the ban;
- ``banned_reason``, ``honest_banned`` (must be empty), ``blackhole_wall_s`` / ``honest_wall_s``;
- ``honest_step_s`` / ``adversary_step_s``: the median step time (between step closes) over each whole
  run from the last node's first step, their ``step_time_ratio``, ``slow_steps`` (the adversary run's
  steps that waited on someone: longer than 3 x the honest median and than the honest median plus the
  late-lease window, ``lease_late_fraction x lease_s``, the least a step that waits on a node that sits
  on its leases is held up; a step slowed by the machine's load alone, or by the survivors taking over
  the work of a node that left, is neither), ``slow_step_s`` (that bound), ``step_gaps_s`` (the
  adversary run's step times, in step order) and ``max_step_s``;
- with ``--kind hang`` (node 0 started as ``--adversary hang:FROM_STEP``): ``left_out_after_s``, how long
  its compute call ran when its watchdog gave up and it left the swarm, and ``hung_error``, the one
  line it exited with.

``--baseline before`` runs no honest swarm: each adversary run is compared with its own steps before FROM_STEP
(after the first ``warmup``, whoever had joined by then: a node that a loaded machine starts late may join
after FROM_STEP), side by side in one run, so the machine's load between two runs does not enter the ratios
(FROM_STEP must leave steps for that window: ``hang:20``, not ``blackhole:2``). Its ``steps_closed[0]`` and
``honest_*`` keys are that window's, ``exit_codes["honest"]`` is empty and ``nodes_joined[0]`` is 0.

``python scripts/bench_blackhole.py [--quick] [--kind hang --stages 2 --from-step 5]`` prints the dict as JSON;
``--kind blackhole:2,hang:20`` runs the honest swarm once and each adversary after it, and prints
``{kind: dict}``. ``scripts/bench.py`` may call :func:`measure` or :func:`measure_kinds`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

STARTUP_S = 90.0
POLL_S = 0.25


# The e2e tests' tiny run (tests/e2e/test_swarm.py): a step takes a fraction of a second on a CPU.
TINY = """
name = "tiny"
seed = 0
steps = {steps}
codec = "none"
[model]
vocab_size = 259
d_model = 64
n_layers = {layers}
n_heads = 4
d_ff = 128
max_seq_len = 64
[stages]
num_stages = {stages}
{split}[batch]
microbatches_per_step = {microbatches}
microbatch_size = 4
seq_len = 32
[optim]
warmup_steps = 2
total_steps = {steps}
[data]
max_bytes = 200000
"""


def _run_toml(stages: int, steps: int, microbatches: int = 6, extra_toml: str = "", *, last_stage_larger: bool = False) -> str:
    """The run; ``extra_toml``: more sections (e.g. ``[sync]`` for DiLoCo mode, bench.py integrity --diloco).
    ``last_stage_larger`` (two stages): one layer in stage 0 and three in stage 1, so that a node's memory can admit
    stage 0 alone (stage 0 holds its microbatches' graphs: with one layer each it needs 6.8 MB against 4.0, with
    two in stage 1 still more than its 6.4; with three, 6.8 against 8.9)."""
    layers, split = (4, "layers = [1, 3]\n") if last_stage_larger else (2, "")
    return TINY.format(steps=steps, stages=stages, microbatches=microbatches, layers=layers, split=split) + extra_toml


@dataclass
class Outcome:
    wall_s: float
    history: list[Any]  # LossRecord: step, loss, num_tickets, closed_at
    bans: list[Any]  # BanView: peer_id, reason, at
    node_peers: dict[int, str]
    # (open step when it joined, wall time of its first applied step: from then on it trains)
    joined: dict[int, tuple[int, float]]
    exit_codes: dict[int, int | None]
    tokens_per_step: int
    node_stages: dict[int, int]  # the stage each node built first


def _start_groups(stages: int, hole_stage: int, stage1_replicas: int, stage0_pair: bool) -> list[list[int]]:
    """The nodes whose stage matters, in groups started one after another (each group joined before the next
    starts; the rest start at once after them). The coordinator places a node by what it finds when it joins,
    and a loaded machine starts processes in any order, so the order is what puts node 0 where it should be:

    - two stage-1 replicas: node 1 takes stage 0, then nodes 2 and 0 (their memory admits only stage 1) together,
      so both train from the first steps (node 0 started after node 2 joined once came in at step 36 of 40);
    - a stage-0 pair: nodes 0 and 1 (pinned to stage 0 by memory) join before node 2, which takes stage 1;
    - the hole in stage 1: an honest node 1 takes stage 0, then node 0 stage 1;
    - the hole in stage 0 of a multi-stage run: node 0 first.
    """
    if stage1_replicas == 2:
        return [[1], [2, 0]]
    if stage0_pair:
        return [[0], [1]]
    if hole_stage == 1:
        return [[1], [0]]
    return [[0]] if stages > 1 else []


def _swarm_run(
    workdir: Path, *, stages: int, steps: int, num_nodes: int, lease_s: float, hole: str | None, deadline_s: float, hole_stage: int = 0,
    stage1_replicas: int = 1, extra_toml: str = "",
) -> Outcome:
    import trio
    from protolearn.cli.demo import LocalSwarm
    from protolearn.stages.config import RunConfig

    from protolearn.stages.footprint import stage_footprints

    # Node 0 in stage 0 with a stage-mate (hole_stage 0, two stages, three nodes or more): the stage a third joiner
    # gets is a keyed draw among stages of near-equal throughput (coordinator/core/assignment.py), and every stage of
    # a pipeline measures the same rate, so only memory can decide it. Stage 1 is made the larger, and nodes 0 and 1
    # offer memory for stage 0 alone. (Unpinned, a third node started 1.4 s late on a loaded machine went to
    # stage 1, and the hang left stage 0 empty: CI, 2026-12-07.)
    stage0_pair = hole_stage == 0 and stages == 2 and num_nodes >= 3
    run_toml = _run_toml(stages, steps, extra_toml=extra_toml, last_stage_larger=stage0_pair)
    run = RunConfig.from_toml_text(run_toml)
    tokens_per_step = run.batch.tokens_per_step
    # With two stage-1 replicas, nodes 2 and 0 offer less memory than stage 0 needs, so placement can only
    # give them stage 1 (a real user's --max-memory; by throughput the second would go to stage 0). With a stage-0
    # pair (above), nodes 0 and 1 offer less than the larger stage 1 needs.
    first, last = [f.total(8) for f in stage_footprints(run)][:2] if stages > 1 else (0, 0)
    pin = ["--max-memory", f"{(first + last) / 2e6:.2f}MB"]
    pinned = {2: pin, 0: pin} if stage1_replicas == 2 else {0: pin, 1: pin} if stage0_pair else {}

    class Swarm(LocalSwarm):
        def _node_args(self, k: int) -> list[str]:
            args = super()._node_args(k) + pinned.get(k, [])
            return args + ["--adversary", hole] if (k == 0 and hole) else args

    os.environ["PROTOLEARN_ALLOW_ADVERSARY"] = "1"  # inherited by the nodes; only node 0 gets --adversary
    swarm = Swarm(workdir, run_toml, num_nodes, threads=1, coordinator_args=["--log-level", "info", "--lease-s", str(lease_s)])
    t0 = time.monotonic()

    async def follow() -> Any:
        from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
        from protolearn.protocol.errors import ProtocolError
        from protolearn.protocol.identity import Identity
        from protolearn.protocol.transport import open_host

        with trio.fail_after(STARTUP_S):
            while not swarm.poll_address():
                await trio.sleep(0.1)
        procs: dict[int, Any] = {}
        groups = _start_groups(stages, hole_stage, stage1_replicas, stage0_pair)
        for group in groups:
            for k in group:
                procs[k] = swarm._popen(swarm._node_args(k), f"node{k}")
            with trio.fail_after(STARTUP_S):
                for k in group:
                    log = workdir / f"node{k}" / "node.jsonl"
                    while not (log.exists() and '"joined"' in log.read_text(errors="replace")):
                        if procs[k].poll() is not None:
                            raise RuntimeError(f"node{k} exited with {procs[k].returncode}: {swarm.tail(f'node{k}')}")
                        await trio.sleep(0.1)
        for k in range(num_nodes):
            if k not in procs:
                procs[k] = swarm._popen(swarm._node_args(k), f"node{k}")
        swarm.nodes.extend(procs[k] for k in range(num_nodes))
        last = None
        async with open_host(Identity.generate()) as host:
            link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))
            with trio.move_on_after(deadline_s):
                while True:
                    try:
                        last = await link.status(loss_history=10_000)
                    except ProtocolError:
                        pass
                    # Done when every honest node exited (a banned blackhole exits, or is stopped below).
                    if all(p.poll() is not None for k, p in enumerate(swarm.nodes) if not (k == 0 and hole)):
                        with trio.move_on_after(10):
                            last = await link.status(loss_history=10_000)
                        return last
                    await trio.sleep(POLL_S)
        return last

    try:
        swarm.start_coordinator()
        status = trio.run(follow)
        codes = {k: p.poll() for k, p in enumerate(swarm.nodes)}
    finally:
        swarm.stop()
    peers, joined, built = {}, {}, {}
    for k in range(num_nodes):
        path = workdir / f"node{k}" / "node.jsonl"
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if d.get("event") == "start" and d.get("peer_id"):
                peers[k] = d["peer_id"]
            if d.get("event") == "built" and k not in built:
                built[k] = int(d["stage"])
            if d.get("event") == "joined":
                joined[k] = (int(d.get("step", 0)), math.inf)
            if d.get("event") == "step" and k in joined:  # its first applied step: it trains now
                joined[k] = (joined[k][0], float(d["t"]))
                break
    history = list(status.loss_history) if status is not None else []
    bans = list(status.bans) if status is not None else []
    return Outcome(time.monotonic() - t0, history, bans, peers, joined, codes, tokens_per_step, built)


def _tokens_per_s(history: list[Any], after: float, tokens_per_step: int) -> tuple[float | None, float | None]:
    """Tokens/s over the steps that closed after ``after``: (mean over the span, from the median step
    interval). Other load on a shared machine stalls a step now and then; the median ignores that."""
    times = sorted(p.closed_at for p in history if p.closed_at > after)
    if len(times) < 3:
        return None, None
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return tokens_per_step * (len(times) - 1) / (times[-1] - times[0]), tokens_per_step / gaps[len(gaps) // 2]


def _gaps(history: list[Any], after: float) -> list[float]:
    times = sorted(p.closed_at for p in history if p.closed_at > after)
    return [b - a for a, b in zip(times, times[1:])]


def _hung(path: Path) -> dict:
    """The ``compute_hung`` event a node's watchdog logged before it left, or {}."""
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if '"compute_hung"' in line:
            return json.loads(line)
    return {}


def _last_error(path: Path) -> str | None:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("error: ")] if path.exists() else []
    return lines[-1] if lines else None


def measure(*, quick: bool = False, stages: int = 1, num_nodes: int = 3, steps: int | None = None, from_step: int = 2,
            lease_s: float | None = None, warmup: int = 2, hole_stage: int = 0, workdir: Path | None = None,
            kind: str = "blackhole", stage1_replicas: int = 1, extra_toml: str = "") -> dict:
    """Run the honest and the blackhole swarm back to back and compare their tokens/s (module docstring)."""
    return measure_kinds({kind: from_step}, quick=quick, stages=stages, num_nodes=num_nodes, steps=steps, lease_s=lease_s,
                         warmup=warmup, hole_stage=hole_stage, workdir=workdir, stage1_replicas=stage1_replicas, extra_toml=extra_toml)[kind]


def measure_kinds(kinds: dict[str, int], *, quick: bool = False, stages: int = 1, num_nodes: int = 3, steps: int | None = None,
                  lease_s: float | None = None, warmup: int = 2, hole_stage: int = 0, workdir: Path | None = None,
                  stage1_replicas: int = 1, extra_toml: str = "", baseline: str = "honest") -> dict[str, dict]:
    """One honest run, then one run per adversary ``kind`` (from its step ``kinds[kind]``), each compared with
    the same honest run: ``{kind: measure()'s dict}``. ``baseline`` "before": no honest run; each adversary run
    is compared with its own steps before the adversary's first (module docstring). Each adversary run is in ``workdir/blackhole`` for
    ``blackhole`` and ``workdir/KIND`` otherwise. ``stage1_replicas`` 2 (with ``hole_stage`` 1): node 0
    is one of stage 1's two replicas, node 2 the other (both offer too little memory for stage 0)."""
    steps = steps or (40 if quick else 80)
    lease_s = lease_s or (2.0 if quick else 4.0)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="protolearn-bench-blackhole-"))
    deadline = 120.0 if quick else 600.0
    if hole_stage not in (0, 1) or (hole_stage == 1 and (stages < 2 or num_nodes < 4)):
        raise ValueError(f"hole_stage {hole_stage}: 0, or 1 with >= 2 stages and >= 4 nodes (so stage 1 keeps a replica after the ban)")
    if stage1_replicas not in (1, 2) or (stage1_replicas == 2 and hole_stage != 1):
        raise ValueError(f"stage1_replicas {stage1_replicas}: 1, or 2 with hole_stage 1")
    if baseline not in ("honest", "before"):
        raise ValueError(f"baseline {baseline!r}: honest or before")
    honest = None if baseline == "before" else _swarm_run(
        workdir / "honest", stages=stages, steps=steps, num_nodes=num_nodes, lease_s=lease_s, hole=None, deadline_s=deadline,
        hole_stage=hole_stage, stage1_replicas=stage1_replicas, extra_toml=extra_toml)
    out = {}
    for kind, from_step in kinds.items():
        where = workdir / ("blackhole" if kind == "blackhole" else kind)
        hole = _swarm_run(where, stages=stages, steps=steps, num_nodes=num_nodes, lease_s=lease_s,
                          hole=f"{kind}:{from_step}", deadline_s=deadline, hole_stage=hole_stage, stage1_replicas=stage1_replicas,
                          extra_toml=extra_toml)
        if honest is None:  # its own steps before the adversary's first, past the warmup
            pre = sorted((p for p in hole.history if p.step < from_step), key=lambda p: p.step)[warmup:]
            base = dataclasses.replace(hole, history=pre, bans=[], exit_codes={}, joined={})
        else:
            base = honest
        out[kind] = _compare(base, hole, kind=kind, from_step=from_step, steps=steps, lease_s=lease_s, stages=stages,
                             num_nodes=num_nodes, warmup=warmup, hole_stage=hole_stage, where=where, workdir=workdir, baseline=baseline)
    return out


def _all_in(run: Outcome) -> float:
    """When the last node that trained at all applied its first step."""
    return max((at for _, at in run.joined.values() if at != math.inf), default=0.0)


def _compare(honest: Outcome, hole: Outcome, *, kind: str, from_step: int, steps: int, lease_s: float, stages: int, num_nodes: int,
             warmup: int, hole_stage: int, where: Path, workdir: Path, baseline: str = "honest") -> dict:
    h_hist = sorted(honest.history, key=lambda p: p.step)
    # The honest window: from the warmup-th step closed after the last node started training. A node that
    # joined too late to train any step (the run ended first) bounds nothing.
    all_in = _all_in(honest)
    after = [p.closed_at for p in h_hist if p.closed_at > all_in]
    honest_tps = _tokens_per_s(h_hist, after[warmup - 1] if len(after) >= warmup else all_in, honest.tokens_per_step)
    hole_peer = hole.node_peers.get(0)
    ban = next((b for b in hole.bans if b.peer_id == hole_peer), None)
    b_hist = sorted(hole.history, key=lambda p: p.step)
    leases = None
    if ban is not None:
        m = re.search(r"held (\d+) leases", ban.reason)
        leases = int(m.group(1)) if m else None
        start = max(ban.at, _all_in(hole))
    else:
        start = b_hist[min(len(b_hist) - 1, from_step + 20)].closed_at if b_hist else 0.0
    hole_tps = _tokens_per_s(b_hist, start, hole.tokens_per_step)
    # Steps closed from the first one it blackholed (from_step, or the step it joined at if later) to the ban.
    first_bad = max(from_step, hole.joined.get(0, (0, 0.0))[0])
    steps_until_ban = sum(1 for p in b_hist if p.step >= first_bad and p.closed_at <= ban.at) if ban is not None else None
    (honest_mean, honest_tps), (hole_mean, hole_tps) = honest_tps, hole_tps
    # Step times over the whole run from the last node's first step (a hung node stops training; its
    # first step still bounds the window): the median, and the steps held up (module docstring: slow_steps).
    honest_gaps, hole_gaps = _gaps(h_hist, all_in), _gaps(b_hist, _all_in(hole))
    honest_step = statistics.median(honest_gaps) if honest_gaps else None
    hole_step = statistics.median(hole_gaps) if hole_gaps else None
    hung = _hung(where / "node0" / "node.jsonl")
    from protolearn.coordinator.config import CoordinatorSettings

    late_s = CoordinatorSettings().lease_late_fraction * lease_s  # as the coordinator runs (--lease-s only is set)
    slow = max(3 * honest_step, honest_step + late_s) if honest_step else None
    return {
        "honest_tokens_per_s": honest_tps,
        "blackhole_tokens_per_s": hole_tps,
        "ratio": (hole_tps / honest_tps) if honest_tps and hole_tps else None,
        "honest_tokens_per_s_mean": honest_mean,
        "blackhole_tokens_per_s_mean": hole_mean,
        "ratio_mean": (hole_mean / honest_mean) if honest_mean and hole_mean else None,
        "banned": ban is not None,
        "banned_reason": ban.reason if ban is not None else None,
        "leases_until_ban": leases,
        "steps_until_ban": steps_until_ban,
        "blackhole_from_step": first_bad,
        "honest_banned": [b.peer_id for b in hole.bans + honest.bans if b.peer_id != hole_peer],
        "steps_closed": [len(honest.history), len(hole.history)],
        "steps": steps,
        "lease_s": lease_s,
        "stages": stages,
        "hole_stage": hole_stage,
        "num_nodes": num_nodes,
        "nodes_joined": [len(honest.joined), len(hole.joined)],
        "honest_wall_s": honest.wall_s,
        "blackhole_wall_s": hole.wall_s,
        "exit_codes": {"honest": honest.exit_codes, "blackhole": hole.exit_codes},
        "honest_step_s": honest_step,
        "adversary_step_s": hole_step,
        "step_time_ratio": (hole_step / honest_step) if honest_step and hole_step else None,
        "slow_steps": sum(1 for g in hole_gaps if slow is not None and g > slow),
        "slow_step_s": slow,
        "step_gaps_s": [round(g, 3) for g in hole_gaps],
        "max_step_s": max(hole_gaps, default=None),
        # hang: the node's own watchdog (node/compute_watch.py) left the swarm: after how long, and the line.
        "left_out_after_s": hung.get("running_s"),
        "hung_error": _last_error(where / "node0.err") if kind == "hang" else None,
        "kind": kind,
        "baseline": baseline,
        "node_stages": {str(k): v for k, v in sorted(hole.node_stages.items())},
        "workdir": str(workdir),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench_blackhole.py")
    parser.add_argument("--quick", action="store_true", help="a small run (under a minute)")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--from-step", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=None)
    parser.add_argument("--hole-stage", type=int, default=0, help="1: the blackhole serves stage 1 (needs --stages 2 --nodes 4)")
    parser.add_argument("--stage1-replicas", type=int, default=1, help="2 (with --hole-stage 1): node 0 is one of stage 1's two replicas")
    parser.add_argument("--kind", default="blackhole", help="how node 0 misbehaves: blackhole or hang, or several as "
                        "KIND[:FROM_STEP],... (one honest run for all; prints {kind: result})")
    parser.add_argument("--baseline", choices=("honest", "before"), default="honest",
                        help="before: no honest run; compare each adversary run with its own steps before FROM_STEP")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    kinds: dict[str, int] = {}
    for item in args.kind.split(","):
        name, _, start = item.partition(":")
        if name not in ("blackhole", "hang") or (start and not start.isdigit()):
            parser.error(f"--kind {item!r}: expected blackhole or hang, optionally with :FROM_STEP")
        kinds[name] = int(start) if start else args.from_step
    out = measure_kinds(kinds, quick=args.quick, stages=args.stages, num_nodes=args.nodes, steps=args.steps, lease_s=args.lease_s,
                        hole_stage=args.hole_stage, workdir=Path(args.workdir) if args.workdir else None, stage1_replicas=args.stage1_replicas, baseline=args.baseline)
    print(json.dumps(out if "," in args.kind else out[next(iter(kinds))]))


if __name__ == "__main__":
    main()
