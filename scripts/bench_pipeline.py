"""Bench suite ``pipeline``: pipeline efficiency, on loopback and on home links, for B = 4 and B = 16.

``python scripts/bench.py pipeline --json [--batches 4,16] [--steps 6] [--warmup 2] [--quick]``

A swarm of S = 2 stages with one replica each (one torch thread per node, the demo run, codec none)
has at best B/(B+S-1) of the throughput of the reference trainer on as many cores: a step's B
microbatches fill and drain the pipeline. ``efficiency`` = swarm tokens/s ÷ (reference tokens/s ×
B/(B+S-1)), so 1.0 is an ideal pipeline with free transfers. The reference is the single-process
trainer (``bench.py reference``, the same B) on **one** thread, times S: what S cores give it with
perfect scaling. (Its two-thread run is no reference on a shared machine: torch's OpenMP threads
spin-wait for each other while one has lost its core, see ``protolearn/cli/local.py``; here it came
out at an eighth of the two-node swarm under load.) For each B, side by side in one invocation: the
reference before and after, the swarm on loopback, and the swarm with every node on ``50mbit,40ms``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINK = "50mbit,40ms"
STAGES = 2


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"protolearn_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _reference(config: Path, steps: int, warmup: int) -> float:
    """The reference trainer's tokens/s on ``config`` on one thread, times S (bench_swarm.py's measurement)."""
    return STAGES * float(_script("bench_swarm")._reference(str(config), steps, warmup, threads=1)["tokens_per_s"])


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4,16", help="microbatches per step B, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per swarm run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="B = 4 only, 2 timed steps after 1")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    batches = [4] if args.quick else [int(b) for b in args.batches.split(",") if b]
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-pipeline-"))
    root.mkdir(parents=True, exist_ok=True)
    internet = _script("bench_internet")
    from protolearn.cli.demo import demo_run_toml
    from protolearn.stages.config import RunConfig

    t0 = time.monotonic()
    out: dict[str, Any] = {"stages": STAGES, "link": LINK, "steps": steps, "by_batch": {}}
    for b in batches:
        config = root / f"B{b}.toml"
        config.write_text(RunConfig.from_toml_text(demo_run_toml(None, stages=STAGES, steps=steps + warmup, codec="none"))
                          .replace(**{"batch.microbatches_per_step": b}).to_toml())
        before = _reference(config, steps, warmup)
        loop = internet.swarm_run(root / f"B{b}-loopback", nodes=STAGES, stages=STAGES, steps=steps, warmup=warmup, microbatches=b)
        shaped = internet.swarm_run(root / f"B{b}-link", nodes=STAGES, stages=STAGES, steps=steps, warmup=warmup, microbatches=b, link=LINK)
        after = _reference(config, steps, warmup)
        ref = (before + after) / 2
        bound = b / (b + STAGES - 1)
        out["by_batch"][str(b)] = {
            "reference_tokens_per_s": round(ref, 1), "reference_before_after": [round(before, 1), round(after, 1)], "reference_threads": 1,
            "reference_scaled_by": STAGES, "bound": round(bound, 4),
            "loopback_tokens_per_s": round(loop["tokens_per_s"], 1), "link_tokens_per_s": round(shaped["tokens_per_s"], 1),
            "loopback_efficiency": round(loop["tokens_per_s"] / (ref * bound), 4), "link_efficiency": round(shaped["tokens_per_s"] / (ref * bound), 4),
            "loopback_breakdown": loop["breakdown"].get("shares", {}), "link_breakdown": shaped["breakdown"].get("shares", {}),
        }
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["workdir"] = str(root)
    return out
