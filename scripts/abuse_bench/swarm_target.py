"""The member attacks' target process: a coordinator and an honest swarm of four replicas that trains on command.

``python -m abuse_bench.swarm_target DATA_DIR NUMEL`` (the bench starts it: :mod:`.harness`). It runs a
coordinator service for the demo run (two stages, four tickets a step) and four honest :class:`~.swarm.Replica`
members, two in each stage, each with its own host: they join in turn with equal throughput, so the
coordinator's placement puts ``h0a``, ``h0b`` in stage 0 and ``h1a``, ``h1b`` in stage 1. The coordinator keeps
its default settings but two: it never rebalances (these replicas do not move stages), and it keeps 64
long-poll slots rather than 1024, so that a few Sybils can fill them (the rule is the same at any size).

Commands (one JSON line each; the answer is one JSON line):

- ``step``: the honest swarm trains one step: the stage-0 replicas lease its tickets, and the answer comes once
  every honest replica has finished it: ``ok`` when each applied it with the step's every ticket once (I1), the
  replicas of each stage hold identical parameters (I2), and all that within :data:`STEP_DEADLINE_S`;
  ``closings`` counts how often it closed (a reopened step closes again);
- ``record``: the coordinator's own record of the given peers (or every member): assigned stage, the stage it
  serves, state, flags and bans, and the stages' loads;
- ``sees``: whether every honest replica's view holds the given peers as live replicas (a new member is routed
  to and averaged with from then on);
- ``stats``: what the coordinator's gate and the honest replicas' gates refused, and their temporary bans;
- ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import AsyncExitStack
from typing import Any

import trio

from abuse_bench.swarm import Replica

HONEST = ("h0a", "h1a", "h0b", "h1b")  # in join order
STAGES = (0, 1, 0, 1)
# A step the honest swarm has not finished within twice a node's long poll ("has the step closed?", 10 s) is stalled.
STEP_DEADLINE_S = 20.0
LONG_POLL_SLOTS = 64


def record(core: object, peers: list[str] | None) -> dict:
    """What the coordinator's core holds about ``peers`` (every member if None), as JSON."""
    reg, verdicts = core.registry, core.verdicts  # type: ignore[attr-defined]
    out = {}
    for p in peers if peers is not None else list(reg.members):
        m = reg.members.get(p)
        out[p] = {"stage": None if m is None else m.stage, "serving": None if m is None else m.serving_stage,
                  "status": None if m is None else m.status, "state": None if m is None else str(m.state),
                  "flags": verdicts.flags_of(p), "banned": verdicts.bans[p].reason if p in verdicts.bans else ""}
    loads = [{"throughput": s.throughput, "replicas": s.replicas} for s in reg.loads()]
    return {"peers": out, "loads": loads, "working": reg.working_counts(), "step": core.ledger.step}  # type: ignore[attr-defined]


def _strikes(flags: list[str]) -> dict[str, int]:
    return {kind: int(n) for kind, _, n in (f.rpartition(":") for f in flags)}


def honest_charged(before: dict, after: dict, honest: list[str], *, claims: tuple[str, ...] = ()) -> dict[str, Any]:
    """The strikes and bans the coordinator gave honest replicas between two records, and any that is no longer a live
    member (empty: none); strikes of the kinds in ``claims`` (a claim's flag, shown and never a ban) are left out."""
    out: dict[str, Any] = {}
    for p in honest:
        was, now = _strikes(before["peers"][p]["flags"]), _strikes(after["peers"][p]["flags"])
        new = {k: n - was.get(k, 0) for k, n in now.items() if n > was.get(k, 0) and k not in claims}
        status = after["peers"][p]["status"]
        if new or after["peers"][p]["banned"] or status != "live":  # e.g. expired: its heartbeats stopped getting through
            out[p] = {"strikes": new, "banned": after["peers"][p]["banned"], "status": status}
    return out


async def serve_target(data_dir: str, numel: int) -> None:
    from protolearn.coordinator.config import CoordinatorSettings
    from protolearn.coordinator.service import serve
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host
    from protolearn.stages.config import default_run

    def say(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    run = default_run()
    settings = CoordinatorSettings(rebalance_interval_s=1e9, max_concurrent_waits=LONG_POLL_SLOTS)
    async with trio.open_nursery() as nursery:
        coord = await nursery.start(lambda task_status: serve(run, data_dir, settings=settings, task_status=task_status))
        async with AsyncExitStack() as stack:
            replicas: list[Replica] = []
            for name in HONEST:
                host = await stack.enter_async_context(open_host(Identity.generate()))
                replicas.append(Replica(host, coord.addrs[0], run, name=name, numel=numel))
            for r in replicas:
                r.donors = lambda r=r: [x for x in replicas if x is not r]
            async with trio.open_nursery() as members:
                for r, want in zip(replicas, STAGES, strict=True):
                    r.allow_leases(-1)
                    stage = await r.join()
                    if stage != want:
                        raise RuntimeError(f"{r.name} was placed in stage {stage}, not {want}: the coordinator's placement changed")
                    await members.start(r.serve)
                say({"coord": coord.addrs[0], "pid": os.getpid(), "honest": {r.name: {"id": r.me, "stage": r.stage} for r in replicas}})
                await _commands(coord, replicas, say)
                members.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def _commands(coord: object, replicas: list[Replica], say: object) -> None:
    async def step() -> dict:
        t = min(r.core.applied for r in replicas)
        t0 = trio.current_time()
        for r in replicas:
            if r.stage == 0:
                r.allow_leases(t)
        outcomes = {}

        async def finish(r: Replica) -> None:
            outcomes[r.name] = await r.outcome(t)

        with trio.move_on_after(STEP_DEADLINE_S):
            async with trio.open_nursery() as wait:
                for r in replicas:
                    wait.start_soon(finish, r)
        s = trio.current_time() - t0
        ok = len(outcomes) == len(replicas) and all(o.how == "applied" and o.update_ok for o in outcomes.values())
        for stage in (0, 1):
            ok = ok and len({outcomes[r.name].param_hash for r in replicas if r.stage == stage and r.name in outcomes}) == 1
        if not ok:
            print(f"honest step {t} failed: {outcomes} (resyncs: {[r.resyncs for r in replicas]})", file=sys.stderr)
        ledger = coord.core.ledger
        closed = ledger.closed.get(t)
        account = {} if closed is None else {st: {p[-6:]: ts for p, ts in peers.items()} for st, peers in closed.accounting().items()}
        out = {"s": s, "ok": ok, "step": t, "account": account, "closings": max((o.closings for o in outcomes.values()), default=0),
               "outcomes": {k: o.how for k, o in outcomes.items()}}
        if not ok:  # what it waited on: the coordinator's open step and who holds its tickets, each replica's state
            holders = {p[-6:]: held for p in coord.core.registry.members if (held := ledger.holdings(p))}
            out["waited"] = {"ledger_step": ledger.step, "remaining": ledger.remaining(), "holders": holders,
                             "replicas": {r.name: {"applied": r.core.applied, "state": r.core.state.value} for r in replicas}}
        return out

    async def answer(cmd: dict) -> None:
        if cmd["cmd"] == "step":
            out = await step()
        elif cmd["cmd"] == "sees":  # whether every honest replica's view holds these peers, live (else: heartbeat now)
            said = set(cmd["peers"])
            missing = [r for r in replicas if not said <= {m.peer_id for m in r.link.members if m.state in ("training", "averaging")}]
            for r in missing:
                r.link.beat_now()
            out = {"ok": not missing}
        elif cmd["cmd"] == "record":
            out = record(coord.core, cmd.get("peers"))
        elif cmd["cmd"] == "stats":
            gates = {"coordinator": [coord.host.gate], "replicas": [r.host.gate for r in replicas]}
            out = {k: {"rejected": sum(sum(g.rejected.values()) for g in gs), "temp_bans": sum(g.abuse.num_bans for g in gs)}
                   for k, gs in gates.items()}
        else:
            out = {"error": f"unknown command {cmd['cmd']!r}"}
        say({**out, "id": cmd.get("id", 0)})

    async with trio.open_nursery() as answering:  # a step takes a while: other commands are answered meanwhile
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            cmd = json.loads(line or '{"cmd": "stop"}')
            if cmd["cmd"] == "stop":
                answering.cancel_scope.cancel()
                return
            answering.start_soon(answer, cmd)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("protolearn").setLevel(os.environ.get("ABUSE_LOG", "WARNING"))
    trio.run(serve_target, sys.argv[1], int(sys.argv[2]))
