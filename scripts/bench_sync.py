"""Bench suite ``sync``: replica sync modes on home links, at equal tokens (issue 24).

``python scripts/bench.py sync --json [--modes none,int8,topk,powersgd,diloco8,diloco32-int8,...] [--seeds 0,1] [--steps 300] [--warmup 5] [--workdir DIR] [--quick]``

For each sync mode (:data:`MODES`: run-config overrides, so a mode is one entry) and seed, the same local
swarm (4 nodes over 2 stages, so both stages have two replicas that average; one torch thread each; the
demo run at ``--steps`` steps, its learning-rate schedule fitted to them) trains with every node on
``50mbit,40ms`` links (the coordinator unshaped). The baseline, per-step ``none``, runs on loopback for
every seed; ``none`` on the link runs only when ``--modes`` names it. Runs go one after another, seed by
seed, loopback first in even seeds and last in odd ones, so a drift in the machine's load spreads over
the modes. Per mode (means over the seeds):

* ``replica_bytes_per_token``: the bytes a replica wrote on its collective streams (parts, fins,
  probes and their headers, counted by the averaging adapter and logged per step as ``sync_bytes``),
  summed over the run, divided by the tokens the swarm trained, averaged over the replicas;
* ``tokens_per_s``: from the coordinator's step closes after ``--warmup`` steps;
* ``final_val_loss``: the run's final model (every stage's last checkpoint, exported and evaluated on
  the run's fixed validation batches, as ``protolearn export`` and ``protolearn evaluate`` do).

Then ``best``: the mode with the fewest bytes per token whose final validation loss is within
:data:`MAX_LOSS_REL_DIFF` of the baseline's (if none is, the one with the smallest loss gap);
``bytes_reduction`` = the baseline's bytes per token / the best mode's (the bytes of a run do not depend on
its link); that mode's ``loss_rel_diff`` = (its loss - the baseline's) / the baseline's; and
``internet_efficiency`` = its tokens/s on the links / the baseline's on loopback, taken per seed (two runs
made next to each other) and then averaged. ``curves`` keeps each mode's loss against the bytes a replica
had sent, which the report plots (``python scripts/bench.py report --only sync``, :mod:`report_links`).

**Resuming.** With ``--workdir``, each finished run leaves ``result.json`` in its folder, and a later call
with the same workdir reuses it instead of training again, if it was made with the same settings (mode,
seed, link, steps, warmup, nodes) by the same package code: the git trees of the package's folders
(``protolearn/``, ``node/``, ``coordinator/``, ``protocol/``, ``stages/``), with no uncommitted change to
them. The whole bench takes hours on a 2-core machine, so it can be run in parts. Each run records when it
ran and the load average around it, and the output lists which runs were reused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

LINK = "50mbit,40ms"
# Each mode: the run-config overrides that select it (per-step averaging, then DiLoCo at H = 8 and 32).
MODES: dict[str, dict[str, Any]] = {
    "none": {"sync.mode": "step", "sync.compression": "none"},
    "int8": {"sync.mode": "step", "sync.compression": "int8"},
    "topk": {"sync.mode": "step", "sync.compression": "topk:0.01"},
    "powersgd": {"sync.mode": "step", "sync.compression": "powersgd:4"},
    "diloco8": {"sync.mode": "diloco", "sync.inner_steps": 8, "sync.compression": "none"},
    "diloco8-int8": {"sync.mode": "diloco", "sync.inner_steps": 8, "sync.compression": "int8"},
    "diloco32": {"sync.mode": "diloco", "sync.inner_steps": 32, "sync.compression": "none"},
    "diloco32-int8": {"sync.mode": "diloco", "sync.inner_steps": 32, "sync.compression": "int8"},
}
BASELINE = "none"
MAX_LOSS_REL_DIFF = 0.02
CLI = [sys.executable, "-m", "protolearn.cli.main"]


def _internet() -> Any:
    spec = importlib.util.spec_from_file_location("protolearn_bench_internet_for_sync", Path(__file__).with_name("bench_internet.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sync_bytes(workdir: Path, tokens_per_step: int) -> tuple[float, list[float]]:
    """Replica sync bytes per token (mean over the replicas), and the mean bytes per replica after each step.

    A replica's sync bytes are those its ``step`` events log (per-step averaging) plus those its ``outer_sync``
    events log (DiLoCo's outer rounds, counted at the step the round followed)."""
    per_node: list[float] = []
    per_step: dict[int, list[int]] = {}
    for log in sorted(workdir.glob("node*/node.jsonl")):
        events = [e for e in map(json.loads, (ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")))
                  if e.get("event") in ("step", "outer_sync")]
        steps = [e for e in events if e["event"] == "step"]
        if not steps:
            continue
        sent: dict[int, int] = {int(e["step"]): 0 for e in steps}
        for e in events:
            sent[int(e["step"])] = sent.get(int(e["step"]), 0) + int(e.get("sync_bytes") or 0)
        per_node.append(sum(sent.values()) / (len(steps) * tokens_per_step))
        for t, b in sent.items():
            per_step.setdefault(t, []).append(b)
    if not per_node:
        raise SystemExit(f"error: no node of {workdir} logged a step")
    cumulative, total = [], 0.0
    for t in sorted(per_step):
        total += statistics.mean(per_step[t])
        cumulative.append(total)
    return statistics.mean(per_node), cumulative


def final_val_loss(workdir: Path) -> tuple[int, float]:
    """(step, validation loss) of the run's final model: the newest checkpoint of each stage, exported and evaluated."""
    newest: dict[int, tuple[int, Path]] = {}
    for path in workdir.glob("node*/**/stage-*-step-*.safetensors"):
        _, stage, _, step = path.stem.split("-")
        if int(step) > newest.get(int(stage), (-1, path))[0]:
            newest[int(stage)] = (int(step), path)
    if not newest or len({s for s, _ in newest.values()}) != 1:
        raise SystemExit(f"error: the stages of {workdir} left no common final checkpoint: {newest}")
    final = workdir / "final"
    final.mkdir(exist_ok=True)
    for stage, (step, path) in newest.items():
        (final / path.name).unlink(missing_ok=True)
        (final / path.name).symlink_to(path.resolve())
    model = final / "model.safetensors"
    for args in (["export", "--checkpoints", str(final), "--out", str(model), "--json"], ["evaluate", "--model", str(model), "--json", "--threads", "1"]):
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"error: protolearn {args[0]} failed on {workdir}: {proc.stderr.strip()[-500:]}")
    out = json.loads(proc.stdout)
    return int(out["step"]), float(out["val_loss"])


def package_tree() -> str | None:
    """One hash of the git trees of the package's folders (pyproject's package-dir), or None if any has an uncommitted change."""
    import hashlib
    import tomllib

    root = Path(__file__).resolve().parent.parent
    dirs = sorted(set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()))
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60, check=False)
    dirty = git("status", "--porcelain", "--", *dirs)
    trees = [git("rev-parse", f"HEAD:{d}") for d in dirs]
    if dirty.returncode != 0 or dirty.stdout.strip() or any(t.returncode != 0 for t in trees):
        return None
    return hashlib.sha1(" ".join(f"{d}:{t.stdout.strip()}" for d, t in zip(dirs, trees)).encode()).hexdigest()


def run_key(mode: str, seed: int, *, link: str | None, steps: int, warmup: int, nodes: int, tree: str | None) -> dict[str, Any]:
    return {"mode": mode, "overrides": MODES[mode], "seed": seed, "link": link, "steps": steps, "warmup": warmup, "nodes": nodes, "package_tree": tree}


def one_run(workdir: Path, mode: str, seed: int, *, link: str | None, steps: int, warmup: int, nodes: int, tree: str | None = None) -> dict[str, Any]:
    """One swarm run of ``mode``; reused from ``workdir/result.json`` if that run had the same key (see the module's Resuming)."""
    from protolearn.stages.config import default_run

    key = run_key(mode, seed, link=link, steps=steps, warmup=warmup, nodes=nodes, tree=tree)
    done = workdir / "result.json"
    if tree is not None and done.is_file():
        try:
            kept = json.loads(done.read_text())
        except (OSError, ValueError):
            kept = {}
        if kept.get("key") == key:
            # The bytes are counted again from the run's logs, so a kept run follows this script's counting.
            bpt, cumulative = sync_bytes(workdir, _tokens_per_step())
            return {**kept["result"], "replica_bytes_per_token": bpt, "cumulative_bytes": cumulative, "reused": True}
    if workdir.exists():
        shutil.rmtree(workdir)  # a run that did not finish, or one made with other settings or code
    workdir.mkdir(parents=True)
    config = workdir / "base.toml"
    config.write_text(default_run().replace(seed=seed, **MODES[mode]).to_toml())
    started, load0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), os.getloadavg()[0]
    r = _internet().swarm_run(workdir, nodes=nodes, stages=2, steps=steps, warmup=warmup, link=link, config=config)
    bpt, cumulative = sync_bytes(workdir, r["tokens_per_step"])
    step, val = final_val_loss(workdir)
    out = {"mode": mode, "seed": seed, "link": link, "tokens_per_s": r["tokens_per_s"], "s_per_step": r["s_per_step"],
           "replica_bytes_per_token": bpt, "final_val_loss": val, "final_step": step, "final_loss": r["final_loss"],
           "losses": r["losses"], "cumulative_bytes": cumulative, "nodes_failed": r["nodes_failed"], "wall_s": r["wall_s"],
           "breakdown": r["breakdown"].get("seconds", {}), "workdir": str(workdir),
           "started": started, "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if tree is not None:
        done.write_text(json.dumps({"key": key, "result": out}))
    return {**out, "reused": False}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "replica_bytes_per_token": round(statistics.mean(r["replica_bytes_per_token"] for r in runs), 2),
        "tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in runs), 1),
        "final_val_loss": round(statistics.mean(r["final_val_loss"] for r in runs), 4),
        "per_seed": {str(r["seed"]): {"replica_bytes_per_token": round(r["replica_bytes_per_token"], 2), "tokens_per_s": round(r["tokens_per_s"], 1),
                                      "final_val_loss": round(r["final_val_loss"], 4), "s_per_step": round(r["s_per_step"], 3),
                                      "averaging_s": r["breakdown"].get("averaging_s"), "nodes_failed": r["nodes_failed"],
                                      "started": r.get("started"), "load_avg": r.get("load_avg")} for r in runs},
    }


def pick_best(modes: dict[str, dict[str, Any]], base_loss: float) -> tuple[str, str]:
    """The mode with the fewest bytes per token within the loss tolerance of the baseline, and the rule that picked it."""
    others = {m: v for m, v in modes.items() if m != BASELINE} or modes
    gap = {m: (v["final_val_loss"] - base_loss) / base_loss for m, v in others.items()}
    within = [m for m in others if gap[m] <= MAX_LOSS_REL_DIFF]
    if within:
        return min(within, key=lambda m: others[m]["replica_bytes_per_token"]), f"fewest bytes per token with loss_rel_diff <= {MAX_LOSS_REL_DIFF}"
    return min(others, key=lambda m: gap[m]), f"no mode within loss_rel_diff {MAX_LOSS_REL_DIFF}: the smallest loss gap"


def efficiency(link_runs: list[dict[str, Any]], loop_runs: list[dict[str, Any]]) -> float:
    """Mean over the seeds of a mode's tokens/s on the links ÷ the baseline's on loopback in the same seed."""
    loop = {r["seed"]: r["tokens_per_s"] for r in loop_runs}
    return statistics.mean(r["tokens_per_s"] / loop[r["seed"]] for r in link_runs)


def curves(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Per mode, its first seed's training loss per step against the MiB a replica had sent by then (for the report's plot)."""
    out = {}
    for mode, rs in runs.items():
        r = rs[0]
        n = min(len(r["losses"]), len(r["cumulative_bytes"]))
        out[mode] = {"seed": r["seed"], "loss": [round(x, 4) for x in r["losses"][:n]],
                     "mib": [round(b / 2**20, 4) for b in r["cumulative_bytes"][:n]]}
    return out


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py sync", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=300, help="steps per run, warmup included (equal tokens for every mode)")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed for tokens/s")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="8 steps, one seed")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"error: --modes must name at least one of {', '.join(MODES)}; got {args.modes!r}")
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",") if s]
    steps, warmup = (8, 2) if args.quick else (args.steps, args.warmup)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-sync-"))
    tree = package_tree() if args.workdir else None
    t0 = time.monotonic()
    common = {"steps": steps - warmup, "warmup": warmup, "nodes": args.nodes, "tree": tree}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    loop_runs: list[dict[str, Any]] = []
    reused: list[str] = []
    for seed in seeds:
        # Loopback first in one seed and last in the other, so a drift of the machine's load biases neither.
        order = [None, *modes] if seed % 2 == 0 else [*modes, None]
        for mode in order:
            if mode is None:
                name, r = f"none-loopback-{seed}", one_run(root / f"none-loopback-{seed}", BASELINE, seed, link=None, **common)
                loop_runs.append(r)
            else:
                name, r = f"{mode}-link-{seed}", one_run(root / f"{mode}-link-{seed}", mode, seed, link=LINK, **common)
                runs[mode].append(r)
            if r["reused"]:
                reused.append(name)
            print(f"sync bench: {mode or 'none (loopback)'} seed {seed} {'reused' if r['reused'] else 'done'} after "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    summary = {m: summarise(rs) for m, rs in runs.items()}
    loopback = summarise(loop_runs)
    best, rule = pick_best(summary, loopback["final_val_loss"])
    out: dict[str, Any] = {
        "link": LINK, "seeds": seeds, "steps": steps, "warmup": warmup, "nodes": args.nodes, "stages": 2,
        "tokens": steps * _tokens_per_step(),
        "modes": {m: {**v, "overrides": MODES[m]} for m, v in summary.items()}, "none_loopback": loopback,
        "baseline": "none on loopback",
        "best": best, "best_rule": rule,
        # None when the best mode sent nothing: a run too short for one outer sync (--quick with a DiLoCo mode).
        "bytes_reduction": round(loopback["replica_bytes_per_token"] / summary[best]["replica_bytes_per_token"], 2)
        if summary[best]["replica_bytes_per_token"] > 0 else None,
        "loss_rel_diff": round((summary[best]["final_val_loss"] - loopback["final_val_loss"]) / loopback["final_val_loss"], 4),
        "internet_efficiency": round(efficiency(runs[best], loop_runs), 4),
        "none_internet_efficiency": round(efficiency(runs[BASELINE], loop_runs), 4) if BASELINE in runs else None,
        "reused_runs": reused, "package_tree": tree,
        "seconds": round(time.monotonic() - t0, 1), "workdir": str(root),
    }
    out["curves"] = curves(runs)
    return out


def _tokens_per_step() -> int:
    from protolearn.stages.config import default_run

    return default_run().batch.tokens_per_step
