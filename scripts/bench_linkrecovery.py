"""Bench suite ``linkrecovery``: joining and recovering when every node is on a ``50mbit,40ms`` home link.

``python scripts/bench.py linkrecovery --json [--link SPEC] [--steps 16] [--warmup 4]``

The node-level recovery measurement of ``bench.py recovery`` (:func:`bench_swarm.recovery_keys`: 3
nodes over 2 stages, the demo run, one replica SIGKILLed after ``--warmup`` steps and restarted on
its data dir), with every node's traffic on ``--link``. Reported: ``kill_to_next_close_s`` (SIGKILL
to the next step closed), ``recover_s`` (until steps close at (n-1)/n of the earlier rate),
``join_to_synced_s`` (the restarted node's join to its stage state installed) and
``join_to_first_microbatch_s``, next to the stage state's size (parameters and both Adam moments,
fp32) and the time that state needs at the link's rate, ``state_transfer_s``; the ratios say how much
of a join is the state's bytes and how much is round trips and compute.
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
BYTES_PER_PARAM = 12  # fp32 weight, exp_avg and exp_avg_sq


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py linkrecovery", description=__doc__.splitlines()[0])
    parser.add_argument("--link", default=LINK)
    parser.add_argument("--steps", type=int, default=16, help="steps of the run (the kill comes after --warmup)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    from protolearn.protocol.link import parse_link

    spec = parse_link(args.link)
    spec_path = ROOT / "scripts" / "bench_swarm.py"
    module_spec = importlib.util.spec_from_file_location("protolearn_bench_swarm", spec_path)
    assert module_spec is not None and module_spec.loader is not None
    swarm = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = swarm
    module_spec.loader.exec_module(swarm)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="protolearn-bench-linkrecovery-"))
    t0 = time.monotonic()
    out = swarm.recovery_keys(steps=args.steps, warmup=args.warmup, workdir=workdir, node_args=["--link", spec.text])
    params = out.get("victim_params") or 0
    state_bytes = params * BYTES_PER_PARAM
    transfer_s = state_bytes * 8 / min(spec.up_bits, spec.down_bits)
    out.update({
        "link": spec.text, "warmup": args.warmup, "state_bytes": state_bytes, "state_transfer_s": round(transfer_s, 3),
        "join_vs_state_transfer": round(out["join_to_first_microbatch_s"] / transfer_s, 3) if transfer_s else None,
        "synced_vs_state_transfer": round(out["join_to_synced_s"] / transfer_s, 3) if transfer_s and out.get("join_to_synced_s") else None,
        "seconds": round(time.monotonic() - t0, 1),
    })
    return out
