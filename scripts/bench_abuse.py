"""Bench suite ``abuse``: attacks on a real coordinator and real nodes over loopback, and what honest peers see.

``python scripts/bench.py abuse --json [--quick]``

Its parts are the package ``scripts/abuse_bench`` (:mod:`abuse_bench.harness` says how each row is measured).
Two groups of attacks run, each against a fresh target process:

- **stream attacks** (:mod:`abuse_bench.stream_attacks`, against :mod:`abuse_bench.node_target`): identities
  that hold, trickle and flood streams, parts, lane slots and joins;
- **member attacks** (issue 27; :mod:`abuse_bench.round_attacks` and :mod:`abuse_bench.member_attacks`, against
  :mod:`abuse_bench.swarm_target`, a coordinator and a small honest swarm that trains step after step): members
  that joined normally and lie with any message their identity can sign.

Each row times the honest operations without and then with its attack, side by side in one run, and says
whether every honest operation, and the outcome the row checks, held (``honest_ok``); ``all_honest_ok`` is
all of them. ``--quick`` shrinks every count (for the test).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import trio

SCRIPTS = Path(__file__).resolve().parent


async def main(sizes: object, workdir: str) -> dict:
    from abuse_bench.harness import start_target
    from abuse_bench.stream_attacks import run_stream_attacks

    target, ready = await start_target("node_target", [str(Path(workdir) / "coord"), str(sizes.numel)], Path(workdir) / "target.log")
    try:
        results, missed = await run_stream_attacks(target, ready, sizes)
    finally:
        await target.stop()
    return {"mem_measure": "target process RSS (VmRSS), end of attack minus before", "attacks": results,
            "background_heartbeats_missed": missed,
            "all_honest_ok": all(r["honest_ok"] for r in results.values())}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py abuse")
    parser.add_argument("--quick", action="store_true", help="small counts (for tests)")
    args = parser.parse_args(argv)
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from abuse_bench.harness import QUICK, Sizes

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # the attackers' own failed dials and streams
    with tempfile.TemporaryDirectory(prefix="protolearn-abuse-") as workdir:
        return trio.run(main, QUICK if args.quick else Sizes(), workdir)
