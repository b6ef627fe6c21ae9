"""Bench suite ``recovery``: the fault-tolerant all-reduce of a 64 MB float32 vector over 4 processes.

``python scripts/bench.py recovery --json [--mib 64] [--peers 4] [--no-bulk] [--no-hivemind] [--no-swarm] [--kill-phase F]``

Each peer is a separate Python process with its own libp2p host on 127.0.0.1, running the node's
collective (:class:`protolearn.node.averaging.Averager`, op ``sum``). The parent drives them over
stdin/stdout, one JSON line each way:

1. a warm-up round (connections, and the bandwidth EMA that scales the deadlines);
2. a timed round with no fault: ``allreduce_s`` is the slowest peer's time from "go" to its result;
3. a timed round in which one peer SIGKILLs itself right after its first scatter part was
   acknowledged: ``allreduce_with_failure_s`` is the slowest survivor's time. The survivors' results
   must be bit-identical (``failure_identical``) and leave exactly the dead peer out.

Parts of 1 MiB or more travel over the transport's bulk lane (protocol/transport/bulk.py);
``clean_lane_parts`` counts those of the clean round (of ``clean_parts``), ``clean_cpu_s`` is the CPU
time all peers spent in it (steadier than wall time on a shared machine), and ``--no-bulk`` turns
the lane off to measure the yamux path.

``ratio_failure`` = allreduce_with_failure_s / allreduce_s (goal < 3). Unless ``--no-hivemind``, the
``hivemind`` suite (scripts/bench_hivemind.py) then runs on the same size and peer count in the same
invocation; its keys are merged in, with ``ratio_vs_hivemind`` = allreduce_s / hivemind_allreduce_s
(goal <= 0.5).

Unless ``--no-swarm``, a local swarm on the default (demo) run then measures the node-level keys
(:func:`bench_swarm.recovery_keys`): ``recover_s``, from SIGKILLing a replica until steps close at
(n-1)/n of the earlier rate again (goal <= max(1 s, one step time), issue 28), a step the kill reopened counting at
its close after the redo (``recover_first_close_s``: the measure before, which never saw that close), and
``join_to_first_microbatch_s``,
from the restarted replica's join until it processes its first microbatch (goal <= 3 s). ``--kill-phase F``
kills F of a step after the close that ends the warm-up instead of as soon as it is seen (``kill_phase``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIVEMIND = ROOT / "scripts" / "bench_hivemind.py"
SWARM = ROOT / "scripts" / "bench_swarm.py"
READY_TIMEOUT_S = 60.0
ROUND_TIMEOUT_S = 300.0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _read_line(proc: subprocess.Popen, deadline: float) -> dict | None:
    """One JSON line from ``proc``, or None if it exits or the deadline passes."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if ready:
            line = proc.stdout.readline()
            if not line:
                return None
            return json.loads(line)
    return None


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py recovery")
    parser.add_argument("--mib", type=int, default=64, help="vector size in MiB of float32 (default 64)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline (scripts/bench_hivemind.py)")
    parser.add_argument("--no-bulk", action="store_true", help="bulk lane off: every part goes through yamux (the old path)")
    parser.add_argument("--no-swarm", action="store_true", help="skip recover_s and join_to_first_microbatch_s (a local swarm)")
    parser.add_argument("--kill-phase", type=float, default=0.0, metavar="F",
                        help="SIGKILL the replica F of a step after a close (0 <= F < 1; default 0: at once, while the step averages)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.kill_phase < 1.0:
        parser.error(f"--kill-phase={args.kill_phase} must be at least 0 and below 1 (a fraction of a step)")
    result = _ours(args)
    if not args.no_hivemind and HIVEMIND.exists():
        result.update(_hivemind(args, result["allreduce_s"]))
    if not args.no_swarm:
        spec = importlib.util.spec_from_file_location("protolearn_bench_swarm", SWARM)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result.update({k: round(v, 3) if isinstance(v, float) else v for k, v in module.recovery_keys(kill_phase=args.kill_phase).items()})
    return result


def _hivemind(args: argparse.Namespace, allreduce_s: float) -> dict:
    """hivemind's DecentralizedAverager on the same tensor size and peer count, via its own suite."""
    from protolearn.errors import ProtolearnError

    spec = importlib.util.spec_from_file_location("protolearn_bench_hivemind", HIVEMIND)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        theirs = module.run(["--peers", str(args.peers), "--mb", str(args.mib)])
    except ProtolearnError as err:
        return {"hivemind_error": str(err)[:500]}
    out = dict(theirs)
    out.pop("peers", None)
    if theirs.get("hivemind_allreduce_s"):
        out["ratio_vs_hivemind"] = round(allreduce_s / theirs["hivemind_allreduce_s"], 3)
    return out


def _ours(args: argparse.Namespace) -> dict:
    numel = args.mib * 1024 * 1024 // 4
    seeds = [os.urandom(32).hex() for _ in range(args.peers)]
    ports = _free_ports(args.peers)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(rank), str(numel), ",".join(seeds), ",".join(map(str, ports)), str(not args.no_bulk)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )
        for rank in range(args.peers)
    ]
    try:
        for p in procs:
            if _read_line(p, time.monotonic() + READY_TIMEOUT_S) is None:
                raise SystemExit("error: a bench peer did not start; run the worker by hand to see why")

        def round_(round_id: int, victim: int | None) -> list[dict | None]:
            for rank, p in enumerate(procs):
                assert p.stdin is not None
                if p.poll() is None:
                    p.stdin.write(json.dumps({"round": round_id, "kill": rank == victim}) + "\n")
                    p.stdin.flush()
            deadline = time.monotonic() + ROUND_TIMEOUT_S
            return [_read_line(p, deadline) if p.poll() is None or rank != victim else None for rank, p in enumerate(procs)]

        warm = round_(0, None)
        clean = round_(1, None)
        if any(r is None or "error" in r for r in clean):
            raise SystemExit(f"error: the fault-free round failed: {clean}")
        victim = args.peers - 2
        faulty = round_(2, victim)
        survivors = [r for k, r in enumerate(faulty) if k != victim]
        if any(r is None or "error" in r for r in survivors):
            raise SystemExit(f"error: a survivor did not finish the round with a failure: {survivors}")
        allreduce_s = max(r["seconds"] for r in clean if r)
        with_failure_s = max(r["seconds"] for r in survivors if r)
        return {
            "mib": args.mib,
            "peers": args.peers,
            "allreduce_s": round(allreduce_s, 3),
            "allreduce_with_failure_s": round(with_failure_s, 3),
            "ratio_failure": round(with_failure_s / allreduce_s, 3),
            "failure_identical": len({r["digest"] for r in survivors if r}) == 1,
            "failure_excluded": survivors[0]["excluded"] if survivors[0] else None,
            "clean_identical": len({r["digest"] for r in clean if r}) == 1,
            # Parts of the clean round that came over the bulk lane (protocol/transport/bulk.py), out of the
            # 2 * peers * (peers - 1) scatter and gather parts a round moves.
            "clean_lane_parts": sum(c["lane_parts"] - w["lane_parts"] for c, w in zip(clean, warm) if c and w),
            "clean_parts": 2 * args.peers * (args.peers - 1),
            # CPU seconds all peers spent in the clean round (all threads): steadier than wall time on a busy box.
            "clean_cpu_s": round(sum(r["cpu_s"] for r in clean if r), 3),
            "bandwidth_ema_mb_s": round(min(r["bandwidth"] for r in clean if r) / 1e6, 1),
            # Slowest peer's time to reduce its own part (the scatter phase) and to commit (gather done).
            "phase_reduced_s": _slowest(clean, "reduced_s"),
            "phase_committed_s": _slowest(clean, "committed_s"),
            "failure_phase_reduced_s": _slowest(survivors, "reduced_s"),
            "failure_phase_committed_s": _slowest(survivors, "committed_s"),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _slowest(results: list[dict | None], key: str) -> float | None:
    values = [r[key] for r in results if r and r.get(key) is not None]
    return round(max(values), 3) if values else None


# -- one peer (a separate process) ------------------------------------------------------------------
def worker(rank: int, numel: int, seeds: list[str], ports: list[int], bulk: bool) -> None:
    import torch
    import trio
    from protolearn.node.averaging import Averager
    from protolearn.protocol.collective import Send
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    from protolearn.errors import ProtolearnError

    class BenchAverager(Averager):
        """Records when this peer reduced its part and when it committed; can crash itself mid-scatter."""

        kill = False
        t_reduced: float | None = None
        t_committed: float | None = None

        def _dispatch(self, actions: list) -> None:
            now = time.monotonic()
            if self.t_reduced is None and any(isinstance(a, Send) and a.phase == "gather" for a in actions):
                self.t_reduced = now
            super()._dispatch(actions)
            if self.t_committed is None and self._round is not None and self._round.committed is not None:
                self.t_committed = now

        async def _send_part(self, a, round_id: int) -> None:  # a: Send | Probe
            await super()._send_part(a, round_id)
            if self.kill and isinstance(a, Send) and a.phase == "scatter":
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-scatter, as a volunteer's machine would

    # Four peers share this machine's cores: one torch thread each avoids oversubscription stalls.
    torch.set_num_threads(1)
    ids = [Identity.from_private_bytes(bytes.fromhex(s)) for s in seeds]
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    async def main() -> None:
        async with open_host(ids[rank], [f"/ip4/127.0.0.1/tcp/{ports[rank]}"], TransportConfig(bulk=bulk)) as host:
            for k, ident in enumerate(ids):
                if k != rank:
                    host.add_peer_addrs(ident.peer_id, [f"/ip4/127.0.0.1/tcp/{ports[k]}"])
            current = {"round": 0}  # the round the parent asks for next: this process's window
            avg = BenchAverager(host, 0, numel, timeout_s=ROUND_TIMEOUT_S, window=lambda: current["round"])
            avg.register()
            weights = {ident.peer_id: 1.0 for ident in ids}
            say({"ready": host.peer_id})
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                if not line:
                    return
                cmd = json.loads(line)
                current["round"] = cmd["round"]
                avg.kill = cmd["kill"]
                avg.t_reduced = avg.t_committed = None
                t0, c0 = time.monotonic(), time.process_time()
                try:
                    done = await avg.run_round_detailed(cmd["round"], weights, vector)
                except ProtolearnError as err:  # reported to the parent, which turns it into one error line
                    say({"error": f"{type(err).__name__}: {err}"})
                    continue
                seconds, cpu_s = time.monotonic() - t0, time.process_time() - c0
                digest = hashlib.sha256(done.result.numpy().tobytes()).hexdigest()[:16]
                say({
                    "seconds": seconds, "digest": digest, "excluded": done.excluded, "bandwidth": avg.bandwidth.bytes_per_s,
                    # Where the time goes: scatter + own reduction, then gather to commit, then the fin barrier.
                    "reduced_s": None if avg.t_reduced is None else avg.t_reduced - t0,
                    "committed_s": None if avg.t_committed is None else avg.t_committed - t0,
                    "lane_parts": host.bulk.stats.num_received if host.bulk is not None else 0,
                    "cpu_s": cpu_s,
                })

    trio.run(main)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), [int(p) for p in sys.argv[5].split(",")], sys.argv[6] == "True")
    else:
        print("run it through bench.py: python scripts/bench.py recovery --json", file=sys.stderr)
        sys.exit(2)
