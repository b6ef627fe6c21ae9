"""Bench suite ``abuse``: attacks on a real coordinator and real nodes over loopback, and what honest peers see.

``python scripts/bench.py abuse --json [--quick]``

Its parts are the package ``scripts/abuse_bench`` (:mod:`abuse_bench.harness` says how each row is measured).
Two groups of attacks run, each against its own target process:

- **stream attacks** (:mod:`abuse_bench.stream_attacks`, against :mod:`abuse_bench.node_target`): identities
  that hold, trickle and flood streams, parts, lane slots and joins;
- **member attacks** (issue 27; :mod:`abuse_bench.round_attacks`, :mod:`abuse_bench.report_attacks` and
  :mod:`abuse_bench.coordinator_attacks`, against :mod:`abuse_bench.swarm_target`, a coordinator and an honest
  swarm that trains one step per honest operation): members that joined normally and lie with any message their
  identity can sign. All seven attacks of issue 27 are here, each over real connections: a liar among a stage's
  three replicas (``round_suspicion``, ``round_fin_liar``), Sybils claiming a role (``role_claims``), liveness
  bans on bare words (``liveness_reports``), ban evasion (``ban_evasion``), stage steering (``stage_steering``),
  ack replay (``ack_replay``) and ``busy`` read as no (``long_poll_slots``).

What the bench leaves to other tests, and why: over loopback the coordinator's cool-down for new keys from a
banned address never applies (loopback is exempt), so ``ban_evasion`` shows only the banned key refused
(``tests/unit/test_ban_cooldown.py`` covers the cool-down); Sybils that are a strict majority of stage 0 may ban
a stage-1 replica that completes nothing while they report it (THREATS.md lists it), so ``liveness_reports`` runs
with the minority placement gives them; Sybil *members* that trickle requests share the coordinator's streams for
members (the per-peer cap holds; the stream rows measure the same limits for non-members).

Each row times the honest operations without and then with its attack, side by side in one run, and says
whether every honest operation, and the outcome the row checks, held (``honest_ok``); ``all_honest_ok`` is
all of them. ``--quick`` shrinks every count and runs the two groups at once (for the test: each group's
numbers then carry the other's load). ``--only GROUP,...`` runs some groups (``streams``, ``rounds``,
``reports``, ``coordinator``); ``ABUSE_WORKDIR=DIR`` keeps the targets' logs there, and ``ABUSE_LOG=INFO``
logs this process's replicas and the swarm target's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import trio

SCRIPTS = Path(__file__).resolve().parent
# The attacks' groups, in the order they run (``--only`` picks some, to re-run them while working on them).
GROUPS = ("streams", "rounds", "reports", "coordinator")
STREAM_ROWS = ("idle_streams", "trickle_streams", "pre_round_flood", "bulk_slots", "bulk_threads", "join_flood", "view_flood")


async def member_attacks(target: Any, ready: dict, sizes: Any, workdir: Path, groups: set[str]) -> dict[str, dict]:
    """The member attacks against the swarm target (its first step, with every first dial, is not timed)."""
    from abuse_bench.coordinator_attacks import coordinator_rows
    from abuse_bench.report_attacks import report_rows
    from abuse_bench.round_attacks import round_rows
    from protolearn.stages.config import default_run

    first = await target.ask("step", timeout=150)
    if not first["ok"]:
        raise RuntimeError(f"the honest swarm could not train its first step: {first}; see {workdir / 'swarm_target.log'}")
    results: dict[str, dict] = {}
    for name, rows in (("rounds", round_rows), ("reports", report_rows), ("coordinator", coordinator_rows)):
        if name in groups:
            results.update(await rows(target, ready, sizes, default_run()))
    return results


def _load_attacks() -> None:
    import abuse_bench.coordinator_attacks  # noqa: F401 - torch, the node's collective and cores
    import abuse_bench.report_attacks  # noqa: F401
    import abuse_bench.round_attacks  # noqa: F401


async def main(sizes: Any, workdir: str, groups: set[str], *, together: bool) -> dict:
    """``together``: the stream and the member attacks run at the same time (shorter, and each group's numbers
    then carry the other's load: for the test, not for the report)."""
    from abuse_bench.harness import start_target
    from abuse_bench.stream_attacks import run_stream_attacks

    work = Path(workdir)
    results: dict[str, dict] = {}
    missed = [0]
    started: dict[str, Any] = {}

    async def start(name: str, args: list[str]) -> None:
        started[name] = await start_target(name, args, work / f"{name}.log")

    async def streams() -> None:
        rows, missed[0] = await run_stream_attacks(*started["node_target"], sizes)
        results.update(rows)
        await started.pop("node_target")[0].stop()

    async def members() -> None:
        results.update(await member_attacks(*started["swarm_target"], sizes, work, groups))

    try:
        # Both targets start at once (each takes seconds to load torch), while this process loads the attacks.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.to_thread.run_sync, _load_attacks, abandon_on_cancel=True))
            if "streams" in groups:
                nursery.start_soon(start, "node_target", [str(work / "coord"), str(sizes.numel)])
            if groups - {"streams"}:
                nursery.start_soon(start, "swarm_target", [str(work / "swarm"), str(sizes.swarm_numel)])
        async with trio.open_nursery() as nursery:
            for name, group in (("node_target", streams), ("swarm_target", members)):
                if name in started:
                    if together:
                        nursery.start_soon(group)
                    else:
                        await group()
    finally:
        for target, _ in started.values():
            await target.stop()
    order = [*STREAM_ROWS, *(k for k in results if k not in STREAM_ROWS)]
    return {"mem_measure": "target process RSS (VmRSS), end of attack minus before",
            "attacks": {k: results[k] for k in order if k in results}, "background_heartbeats_missed": missed[0],
            "all_honest_ok": all(r["honest_ok"] for r in results.values())}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py abuse")
    parser.add_argument("--quick", action="store_true", help="small counts (for tests)")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of attacks to run, of {','.join(GROUPS)}")
    args = parser.parse_args(argv)
    groups = set(args.only.split(","))
    if not groups <= set(GROUPS):
        raise SystemExit(f"error: --only: unknown group(s) {sorted(groups - set(GROUPS))}; choose from {','.join(GROUPS)}")
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from abuse_bench.harness import QUICK, Sizes

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # the attackers' own failed dials and streams
    logging.getLogger("protolearn.bench").setLevel(os.environ.get("ABUSE_LOG", "ERROR"))  # this process's replicas
    keep = os.environ.get("ABUSE_WORKDIR")  # keep the targets' logs and state there, to look into a run
    with tempfile.TemporaryDirectory(prefix="protolearn-abuse-") as workdir:
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
        return trio.run(partial(main, QUICK if args.quick else Sizes(), keep or workdir, groups, together=args.quick))
