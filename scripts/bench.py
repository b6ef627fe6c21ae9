"""The single benchmark entry point: ``python scripts/bench.py SUITE [--json] [suite args...]``.

Each suite is a module ``scripts/bench_<suite>.py`` with ``run(argv: list[str]) -> dict``; ``argv``
holds the arguments after the suite name that bench.py does not use itself, for the suite's own
argparse. Suites are imported by path, lazily, so adding one is one file and one SUITES entry.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent

SUITES: dict[str, str] = {
    "reference": "scripts/bench_reference.py",
    "transport": "scripts/bench_transport.py",
    "hivemind": "scripts/bench_hivemind.py",
    "swarm": "scripts/bench_swarm.py",
    "recovery": "scripts/bench_recovery.py",
    "coordinator": "scripts/bench_coordinator.py",
    "coordinator-net": "scripts/bench_coordinator_net.py",
    "restart": "scripts/bench_restart.py",
    "abuse": "scripts/bench_abuse.py",
    "integrity": "scripts/bench_integrity.py",
    "compression": "scripts/bench_compression.py",
    "nat": "scripts/bench_nat.py",
    "links": "scripts/bench_links.py",
    "internet": "scripts/bench_internet.py",
    "pipeline": "scripts/bench_pipeline.py",
    "linkrecovery": "scripts/bench_linkrecovery.py",
    "report": "scripts/bench_report.py",
    "framing": "scripts/bench_framing.py",
    "sync": "scripts/bench_sync.py",
    "simcurves": "scripts/bench_simcurves.py",
    "simcheck": "scripts/bench_simcheck.py",
}


def _load(suite: str):  # noqa: ANN202 - returns a module
    path = SCRIPTS.parent / SUITES[suite]
    spec = importlib.util.spec_from_file_location(f"protolearn_bench_{suite}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"error: cannot load bench suite '{suite}' from {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses (and forked worker processes) look a module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    # No -h of its own: `bench.py SUITE --help` reaches the suite's parser.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("suite", help=f"one of: {', '.join(sorted(SUITES))}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    if args.suite not in SUITES:
        print(f"error: unknown bench suite '{args.suite}'; choose one of: {', '.join(sorted(SUITES))}", file=sys.stderr)
        return 2
    from protolearn.errors import ProtolearnError

    try:
        result = _load(args.suite).run(rest)
    except ProtolearnError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    result = {"suite": args.suite, **result}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
