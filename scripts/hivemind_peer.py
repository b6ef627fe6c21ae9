"""One hivemind ``DecentralizedAverager`` peer for ``scripts/bench_hivemind.py`` (run by the hivemind venv's python).

Not part of protolearn and never imported by it: it needs hivemind, which lives in its own venv
(``.bench-venv/hivemind``). The bench starts one process per peer in its own session, so that a
SIGKILL of the process group takes down the peer's DHT and averager processes and its p2pd too.

Loopback only: the DHT listens on 127.0.0.1 with NAT port mapping, AutoNAT and relays off.

Peer ``i`` averages one float32 tensor ``t_i[k] = (k % 3) + 2**i``. After a round, ``t[k] - (k % 3)``
is the mean of ``2**j`` over the peers ``j`` whose contribution reached element ``k``, and every
subset of 4 peers has a distinct mean, so the result tells exactly whose parts are in where.

Protocol: commands on stdin, one per line: ``round R`` (reset the tensor, look for a group and wait
at the trigger), ``go`` (trigger the all-reduce, wait for it), ``quit``. Events on stdout, one JSON
object per line prefixed with ``@@ `` (hivemind logs to stderr): ready, awaiting, done, error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time


def emit(**event: object) -> None:
    print("@@ " + json.dumps(event), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--prefix", default="protolearn_bench")
    p.add_argument("--next-chunk-timeout", type=float, default=None)
    p.add_argument("--allreduce-timeout", type=float, default=None)
    p.add_argument("--matchmaking-time", type=float, default=3.0)
    p.add_argument("--round-timeout", type=float, default=120.0, help="bound on waiting for one round's result")
    args = p.parse_args()

    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)  # 4 peers share 2 cores; the averaging is memory- and network-bound anyway
    dht = hivemind.DHT(
        start=True,
        initial_peers=args.initial_peer or None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
    )
    base = (torch.arange(args.numel) % 3).float()  # (N,)
    own = base + float(2**args.index)
    averager = hivemind.averaging.DecentralizedAverager(
        [own.clone()],
        dht,
        start=True,
        prefix=args.prefix,
        target_group_size=args.group_size,
        min_group_size=args.group_size,
        min_matchmaking_time=args.matchmaking_time,
        request_timeout=min(1.0, args.matchmaking_time / 2),
        next_chunk_timeout=args.next_chunk_timeout,
        allreduce_timeout=args.allreduce_timeout,
    )
    emit(event="ready", index=args.index, maddrs=[str(m) for m in dht.get_visible_maddrs()])

    control = None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] == "round":
            with averager.get_tensors() as tensors:
                tensors[0].copy_(own)
            control = averager.step(wait=False, require_trigger=True, allow_retries=False, timeout=args.round_timeout)
            deadline = time.monotonic() + args.round_timeout
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            if control.stage == AveragingStage.AWAITING_TRIGGER:
                emit(event="awaiting", round=int(cmd[1]))
            else:
                emit(event="error", round=int(cmd[1]), error=f"no group formed (stage {control.stage.name})")
        elif cmd[0] == "go" and control is not None:
            t_go = time.time()
            control.allow_allreduce()
            error = None
            try:
                control.result(timeout=args.round_timeout)
            except BaseException as err:  # noqa: BLE001 - reported to the bench, which is the point
                error = f"{type(err).__name__}: {err}"[:300]
            t_done = time.time()
            # get_tensors() would block for as long as a stuck all-reduce holds the tensors; take the same
            # lock with a timeout instead and read the tensor it guards.
            codes, digest = None, None
            if averager.lock_averaged_tensors.acquire(timeout=10):
                try:
                    result = averager._averaged_tensors[0]
                    values, counts = torch.unique((result - base).round(decimals=3), return_counts=True)
                    codes = {f"{v:.3f}": int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}
                    digest = hashlib.sha256(result.numpy().tobytes()).hexdigest()
                finally:
                    averager.lock_averaged_tensors.release()
            emit(event="done", t_go=t_go, t_done=t_done, error=error, digest=digest, codes=codes)
            control = None
    averager.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
