"""One load-generator process of ``bench.py coordinator-net``: many member identities, each a real libp2p client.

``python scripts/coordinator_load.py --coordinator ADDR --worker W --seed S``

Every identity here is what a node looks like to the coordinator, less the training: its own Ed25519 key
(seeded from ``--seed`` and ``--worker``, so a run can be repeated), its own transport
:func:`~protolearn.protocol.transport.open_host` (TCP + Noise + yamux, the same code nodes run), and
its own :class:`~protolearn.node.coordinator_link.CoordinatorLink`: it joins (the coordinator places it
in a stage), then runs the link's own ``heartbeat_loop``, which beats at the interval the coordinator
set. The heartbeat says it trains its stage and applied no step yet. Nothing is bypassed: each join and
heartbeat is a request on a new ``/protolearn/coordinator/1.0.0`` stream over the member's one Noise
connection. The one thing a load member does not do that a node does is keep the membership view: it
drops the members a reply carries (it routes nothing), so that thousands of views do not fill this
process; the coordinator builds and sends them all the same.

The process is driven over stdin/stdout, one JSON object per line:

- ``{"cmd": "grow", "to": K, "rate": R, "concurrency": C}``: start members until K run here, at most R
  joins a second and C at once; answers ``{"event": "grown", ...}`` with the join times and failures;
- ``{"cmd": "measure", "seconds": T}``: answers after T seconds with every heartbeat round trip that
  ended in that window (ms), the beats sent, and the members that failed (a refusal, a timeout, or a
  rejoin: the coordinator expired it) since the last window;
- ``{"cmd": "stop"}``: close every member's host and exit.

Every wait is bounded: a request by the link's retry policy (``--request-timeout``, ``--retry-for``), a
join by the same, and the process exits when stdin closes (its bench died).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time
import json
import logging
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused, RetryPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import TransportConfig, open_host

LISTEN = "/ip4/127.0.0.1/tcp/0"
# A command line is at most this long (a bench sends a few dozen bytes).
MAX_COMMAND = 4096


@dataclass
class Stats:
    """What the members of this process saw since the last window (latencies) and in all (the rest)."""

    latencies_ms: list[float] = field(default_factory=list)
    beats: int = 0
    join_ms: list[float] = field(default_factory=list)
    stages: Counter[int] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    rejoins: int = 0
    running: int = 0
    # Garbage-collector pauses of this process (ms): they delay the replies it reads, whoever answered.
    gc_pauses_ms: list[float] = field(default_factory=list)


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stats = Stats()
        self.started = 0
        self.config = TransportConfig(
            request_timeout_s=args.request_timeout, connect_timeout_s=args.request_timeout, bulk=False,
        )
        self.retry = RetryPolicy(retry_for_s=args.retry_for, request_timeout_s=args.request_timeout)
        self.rng = random.Random(f"{args.seed}:{args.worker}")
        # The heartbeat interval the coordinator last told a member here (it grows with the swarm).
        self.interval_s = 0.0

    def identity(self, i: int) -> Identity:
        return Identity.from_private_bytes(hashlib.sha256(f"coordinator-net:{self.args.seed}:{self.args.worker}:{i}".encode()).digest())

    async def member(self, i: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Member ``i``: join, then heartbeat until cancelled; started once it joined or failed to."""
        stats = self.stats
        phase = self.rng.random()
        placed = False
        try:
            async with open_host(self.identity(i), [LISTEN], self.config) as host:
                link = CoordinatorLink(host, self.args.coordinator, retry=self.retry)
                t0 = trio.current_time()
                reply = await link.join(cm.Join(
                    addrs=host.addrs()[:1], device="cpu", throughput=100.0, name=f"load-{self.args.worker}-{i}",
                ))
                stats.join_ms.append(1e3 * (trio.current_time() - t0))
                self.interval_s = reply.heartbeat_interval_s
                stats.stages[reply.stage] += 1
                link.members = []  # a load member routes nothing (module docstring)
                stats.running += 1
                placed = True
                task_status.started()
                # Spread the beats over the interval, as nodes that joined at different times are.
                await trio.sleep(phase * reply.heartbeat_interval_s)
                sent = 0.0
                rejoins = 0

                def make() -> cm.Heartbeat:
                    nonlocal sent
                    sent = trio.current_time()
                    stats.beats += 1
                    return cm.Heartbeat(state="training", throughput=100.0, stage=link.stage)

                def on_reply(_reply: cm.HeartbeatReply) -> None:
                    nonlocal rejoins
                    stats.latencies_ms.append(1e3 * (trio.current_time() - sent))
                    self.interval_s = link.heartbeat_interval_s
                    link.members = []
                    if link.rejoins != rejoins:  # the coordinator had expired it: a dropped member
                        stats.rejoins += link.rejoins - rejoins
                        rejoins = link.rejoins

                await link.heartbeat_loop(make, on_reply)
        except CoordinatorRefused as err:
            stats.failures[err.code] += 1
        except ProtocolError as err:
            stats.failures[type(err).__name__] += 1
        if placed:
            stats.running -= 1
        else:
            task_status.started()

    async def grow(self, nursery: trio.Nursery, to: int, rate: float, concurrency: int) -> dict[str, Any]:
        t0 = trio.current_time()
        before = len(self.stats.join_ms)
        failed_before = sum(self.stats.failures.values())
        limit = trio.CapacityLimiter(max(1, concurrency))

        async def start(i: int) -> None:
            async with limit:
                await nursery.start(self.member, i)

        async with trio.open_nursery() as joins:
            while self.started < to:
                await limit.acquire()  # pace on free slots as well as the rate
                limit.release()
                joins.start_soon(start, self.started)
                self.started += 1
                await trio.sleep(1.0 / rate)
        # What the members allocated so far is there to stay: the collector need not scan it again, so its
        # pauses (over a second, measured, with a thousand hosts here) do not delay the replies it times.
        gc.collect()
        gc.freeze()
        return {
            "event": "grown", "members": self.stats.running, "started": self.started, "seconds": trio.current_time() - t0,
            "join_ms": [round(x, 2) for x in self.stats.join_ms[before:]],
            "failed": sum(self.stats.failures.values()) - failed_before, "stages": dict(self.stats.stages),
            "interval_s": self.interval_s,
        }

    async def measure(self, seconds: float) -> dict[str, Any]:
        s = self.stats
        s.latencies_ms, beats0, s.gc_pauses_ms = [], s.beats, []
        await trio.sleep(seconds)
        lat, s.latencies_ms = s.latencies_ms, []
        return {
            "event": "window", "seconds": seconds, "latencies_ms": [round(x, 2) for x in lat], "beats": s.beats - beats0,
            "running": s.running, "failures": dict(s.failures), "rejoins": s.rejoins, "interval_s": self.interval_s,
            "gc_pause_max_ms": round(max(s.gc_pauses_ms, default=0.0), 1), "gc_pause_total_ms": round(sum(s.gc_pauses_ms), 1),
        }


async def _commands(stream: trio.lowlevel.FdStream) -> Any:
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = await stream.receive_some(MAX_COMMAND)
            if not chunk:
                return
            buf += chunk
            if len(buf) > MAX_COMMAND:
                raise SystemExit("error: a command line over 4 KiB")
        line, buf = buf.split(b"\n", 1)
        yield json.loads(line)


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _watch_gc(stats: Stats) -> None:
    started = 0.0

    def callback(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            stats.gc_pauses_ms.append(1e3 * (time.perf_counter() - started))

    gc.callbacks.append(callback)


async def main(args: argparse.Namespace) -> None:
    load = Load(args)
    _watch_gc(load.stats)
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    _say({"event": "ready", "pid": os.getpid()})
    async with trio.open_nursery() as nursery:
        async for cmd in _commands(stdin):
            if cmd["cmd"] == "grow":
                _say(await load.grow(nursery, int(cmd["to"]), float(cmd.get("rate", 50.0)), int(cmd.get("concurrency", 16))))
            elif cmd["cmd"] == "measure":
                _say(await load.measure(float(cmd["seconds"])))
            elif cmd["cmd"] == "stop":
                break
        nursery.cancel_scope.cancel()
    _say({"event": "stopped"})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="coordinator_load.py", description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="the coordinator's full multiaddr (with /p2p/)")
    p.add_argument("--worker", type=int, default=0, help="this process's number (its identities differ from the others')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=10.0, help="one request's deadline (s)")
    p.add_argument("--retry-for", type=float, default=20.0, help="how long a request is retried (s)")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    trio.run(main, parse())
