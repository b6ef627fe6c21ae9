"""Simulate a swarm on the real sans-IO cores: ``python scripts/simulate.py [--scenario FILE] [--nodes N] ... [--json]``.

A discrete-event simulation (``protolearn/sim/``) of N nodes with heterogeneous compute and home links,
churn and a coordinator restart, driving the coordinator core, the node, lease and route cores and the
balancer that real nodes run. ``--json`` prints one JSON object (``nodes``, ``stages``, ``goodput``,
``tokens_per_s``, ``coordinator_cpu_per_s``, ``wall_s`` and the rest of :mod:`protolearn.sim.report`).
Without ``--scenario`` the built-in default scenario runs; the flags override the scenario's values.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from protolearn.coordinator.heap import young_collections_only
    from protolearn.errors import ProtolearnError
    from protolearn.sim import report
    from protolearn.sim.scenario import load_scenario, parse_duration
    from protolearn.sim.swarm import Swarm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", help="a scenario TOML file (see scripts/scenarios/)")
    p.add_argument("--nodes", type=int, help="nodes (the size churn keeps the swarm at)")
    p.add_argument("--stages", type=int, help="pipeline stages")
    p.add_argument("--hours", type=float, help="simulated hours")
    p.add_argument("--mean-lifetime", help="mean node lifetime, e.g. 2h, 15m (0: no churn)")
    p.add_argument("--seed", type=int, help="seed of every random draw")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="any scenario field, e.g. --set run.batch.microbatches_per_step=512 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the cores log every redo and ban: thousands of lines at scale
    try:
        scenario = load_scenario(args.scenario)
        updates: dict[str, object] = {}
        if args.nodes is not None:
            updates["swarm.nodes"] = args.nodes
        if args.stages is not None:
            updates["swarm.stages"] = args.stages
        if args.hours is not None:
            updates["swarm.hours"] = args.hours
        if args.seed is not None:
            updates["swarm.seed"] = args.seed
        if args.mean_lifetime is not None:
            updates["churn.mean_lifetime_s"] = parse_duration(args.mean_lifetime, field="--mean-lifetime")
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ProtolearnError(f"--set {item!r}: write it as PATH=VALUE, e.g. --set churn.graceful_share=0.8")
            updates[key.strip()] = json.loads(value) if value.strip()[:1] in "0123456789-[{tfn\"" else value
        if updates:
            scenario = scenario.with_overrides(**updates)
        t0 = time.perf_counter()
        with young_collections_only():  # full collections walked its millions of objects: 10% of a run
            out = Swarm(scenario).run()
        result = report.build(out, time.perf_counter() - t0)
    except ProtolearnError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(report.lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
