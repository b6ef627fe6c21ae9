"""Bench suite ``abuse``: network-level attacks on a real coordinator and a node, and what honest peers see.

``python scripts/bench.py abuse --json [--quick]``

The target is a separate process (``bench_abuse.py --target DIR``): a coordinator service
(:func:`protolearn.coordinator.service.serve`, default transport limits) and a stage-1 node host with
the collective handler (an :class:`~protolearn.node.averaging.Averager` that knows its stage's two
members) plus a tensor ``sink`` protocol that takes any peer's tensor (as the activation lane does),
and a second member host to average with. This process runs the honest peer and the attackers, all
on loopback. Per attack, the honest operations are timed first without and then with the attack
running (side by side in one run), and:

- ``honest_ok``: every honest operation under attack succeeded (and gave the right answer);
- ``latency_ratio``: median honest latency under attack / without it (the worst of the attack's ops);
- ``mem_growth_bytes``: the **target process's RSS** (``/proc/<pid>/status`` VmRSS) at the end of
  the attack minus before it (RSS, not tracemalloc, since the target is another process).

Attacks: ``idle_streams`` (5 identities each open 24 idle streams on the coordinator's and the
collective protocol and reopen them when cut); ``trickle_streams`` (5 identities x 8 streams sending
a request one byte a second); ``pre_round_flood`` (a non-member sends 40 parts of the full vector
for the next rounds; honest op: a real 2-member round); ``bulk_slots`` (one identity asks for 12 lane
offers and sits on them, and 60 silent lane connections come from 127.0.0.2); ``bulk_threads``
(5 identities dial every offer they get and trickle a byte a second); ``join_flood`` (40 Sybil
identities join at once; honest ops: heartbeat, and a fresh honest join); ``view_flood`` (the Sybils
leave and rejoin and flip their state without pause, churning the view; honest op: heartbeat).
``--quick`` shrinks every count (for the test).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, NamedTuple

import trio

SEED = 20261130
STAGE = 1


class Sizes(NamedTuple):  # not a dataclass: bench.py loads this file by path, outside sys.modules
    numel: int = 256 * 1024  # the stage vector: 1 MiB of float32
    identities: int = 5
    idle_per_identity: int = 24
    trickles_per_identity: int = 8
    flood_parts: int = 40
    offers: int = 12
    hellos: int = 60
    sybils: int = 40
    honest_ops: int = 8
    rounds: int = 3
    window_s: float = 4.0  # each honest measurement lasts at least this long


QUICK = Sizes(numel=64 * 1024, identities=2, idle_per_identity=20, trickles_per_identity=3, flood_parts=10, offers=6,
              hellos=24, sybils=6, honest_ops=3, rounds=2, window_s=0.5)


# -- the target process -------------------------------------------------------------------------


async def _target(data_dir: str, numel: int) -> None:
    import torch

    from protolearn.coordinator.service import serve
    from protolearn.node.averaging import Averager
    from protolearn.protocol.rounds import REVISIONS_PER_STEP
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.pipeline import Ack
    from protolearn.protocol.tensors import from_frame
    from protolearn.protocol.transport import FramedStream, open_host
    from protolearn.stages.config import default_run

    async def sink(peer: str, s: FramedStream) -> None:
        frame = await s.receive_tensor(codec="none", dtype=torch.float32)
        from_frame(frame, peer=peer, dtype=torch.float32, require_finite=True)
        await s.send(Ack())

    def say(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async with trio.open_nursery() as nursery:
        coord = await nursery.start(lambda task_status: serve(default_run(), data_dir, task_status=task_status))
        async with open_host(Identity.generate()) as node, open_host(Identity.generate()) as member:
            members = {node.peer_id, member.peer_id}
            # Rounds are numbered as a node numbers them (one step apart), so only the last few results are kept.
            upcoming = [REVISIONS_PER_STEP]
            avgs = [Averager(h, STAGE, numel, timeout_s=20.0, members=lambda: members, window=lambda: upcoming[0]) for h in (node, member)]
            for a in avgs:
                a.register()
            node.add_peer_addrs(member.peer_id, member.addrs())
            member.add_peer_addrs(node.peer_id, node.addrs())
            node.serve_stream("sink", sink)
            say({"coord": coord.addrs[0], "node": node.addrs()[0], "node_id": node.peer_id, "pid": os.getpid()})
            weights = {node.peer_id: 1.0, member.peer_id: 1.0}
            gen = torch.Generator().manual_seed(SEED)
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                cmd = json.loads(line or '{"cmd": "stop"}')
                if cmd["cmd"] == "stop":
                    break
                if cmd["cmd"] == "member":  # the honest peer is a member of the stage in the node's view
                    members.add(cmd["peer"])
                    say({"members": len(members)})
                    continue
                if cmd["cmd"] == "stats":  # what the two gates refused, and how many temporary bans they gave
                    gates = {"node": node.gate, "coordinator": coord.host.gate}
                    say({k: {"rejected": sum(g.rejected.values()), "temp_bans": g.abuse.num_bans} for k, g in gates.items()})
                    continue
                if cmd["cmd"] == "next":
                    say({"next": avgs[0].next_round})
                    continue
                vectors = [torch.randn(numel, generator=gen) for _ in avgs]
                r = upcoming[0]
                out: dict[int, torch.Tensor] = {}
                t0 = trio.current_time()
                try:
                    with trio.fail_after(30):
                        async with trio.open_nursery() as rounds:
                            for k, a in enumerate(avgs):
                                async def one(k: int = k, a: Averager = a) -> None:
                                    out[k] = await a.run_round(r, weights, vectors[k])
                                rounds.start_soon(one)
                    ok = torch.equal(out[0], out[1]) and torch.allclose(out[0], vectors[0] + vectors[1])
                except Exception as err:  # the bench reports it as a failed honest round
                    print(f"round {r} failed: {type(err).__name__}: {err}", file=sys.stderr)
                    ok = False
                upcoming[0] = r + REVISIONS_PER_STEP
                say({"s": trio.current_time() - t0, "ok": ok, "next": upcoming[0]})
        nursery.cancel_scope.cancel()


# -- this process: control, honest peer, attackers -----------------------------------------------


class Target:
    """The target process, driven by JSON lines on its stdin/stdout."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = b""

    async def read(self, timeout: float = 60.0) -> dict:
        assert self.proc.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buf:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    raise RuntimeError("the target process exited; see its log")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def ask(self, cmd: str, timeout: float = 60.0, **args: Any) -> dict:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        return await self.read(timeout)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


Op = Callable[[], Awaitable[bool]]


async def _timed(ops: dict[str, Op], n: int, window_s: float = 0.0) -> tuple[bool, dict[str, float]]:
    """Run the honest ops in turn, each at least ``n`` times and until ``window_s`` has passed; their median times."""
    from protolearn.errors import ProtolearnError

    ok = True
    samples: dict[str, list[float]] = {name: [] for name in ops}
    end = trio.current_time() + window_s
    for _ in range(10_000):
        if all(len(v) >= n for v in samples.values()) and trio.current_time() >= end:
            break
        for name, op in ops.items():
            t0 = trio.current_time()
            try:
                with trio.fail_after(30):
                    good = await op()
            except (ProtolearnError, trio.TooSlowError) as err:
                print(f"honest {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
                good = False
            ok = ok and good
            samples[name].append(trio.current_time() - t0)
        await trio.sleep(0.05)  # an honest node's pace, not a flood of its own
    return ok, {name: statistics.median(v) for name, v in samples.items()}


async def _measure(target: Target, ops: dict[str, Op], sizes: Sizes, attack: Callable[..., Awaitable[None]]) -> dict:
    n = sizes.rounds if "round" in ops else sizes.honest_ops
    await _timed(ops, 1)  # warm-up (first dials, the lane's first connection), not counted
    base_ok, base = await _timed(ops, n, sizes.window_s)
    before = await target.ask("stats")
    rss0 = target.rss()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            await nursery.start(attack)
        under_ok, under = await _timed(ops, n, sizes.window_s)
        rss1 = target.rss()
        after = await target.ask("stats")
        nursery.cancel_scope.cancel()
    ratio = max(under[k] / max(base[k], 1e-6) for k in ops)
    gates = {f"{k}_{what}": after[k][what] - before[k][what] for k in after for what in after[k]}
    return {"honest_ok": base_ok and under_ok, "latency_ratio": round(ratio, 3), "mem_growth_bytes": rss1 - rss0, **gates,
            "honest_ms": {k: round(1000 * under[k], 2) for k in ops}, "baseline_ms": {k: round(1000 * base[k], 2) for k in ops}}


async def _hosts(stack: AsyncExitStack, n: int, peers: dict[str, str]) -> list[Any]:
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host

    hosts = [await stack.enter_async_context(open_host(Identity.generate())) for _ in range(n)]
    for h in hosts:
        for pid, addr in peers.items():
            h.add_peer_addrs(pid, [addr])
    return hosts


def _quiet(*errors: type[BaseException]) -> tuple[type[BaseException], ...]:
    from libp2p.exceptions import BaseLibp2pError

    from protolearn.errors import ProtolearnError

    return (ProtolearnError, BaseLibp2pError, OSError, trio.TooSlowError, *errors)


async def main(sizes: Sizes, workdir: str) -> dict:
    import torch

    from protolearn.protocol import coordination as cm
    from protolearn.protocol import wire
    from protolearn.protocol.collective import PartHeader
    from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse
    from protolearn.protocol.tensors import to_frame
    from protolearn.protocol.transport import TensorHeader
    from protolearn.protocol.transport.bulk_offers import BulkChoice, BulkDecline, BulkOffer
    from protolearn.protocol.transport.seal import dial

    errors = _quiet()
    log_path = Path(workdir) / "target.log"
    with open(log_path, "wb") as log_file:
        argv = [sys.executable, __file__, "--target", str(Path(workdir) / "coord"), "--numel", str(sizes.numel)]
        proc = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file)
    target = Target(proc)
    try:
        ready = await target.read(timeout=90)
        coord_addr, coord_id = ready["coord"], ready["coord"].rsplit("/p2p/", 1)[1]
        node_id = ready["node_id"]
        peers = {coord_id: coord_addr.rsplit("/p2p/", 1)[0], node_id: ready["node"].rsplit("/p2p/", 1)[0]}
        results: dict[str, dict] = {}
        async with AsyncExitStack() as stack:
            (honest,) = await _hosts(stack, 1, peers)
            await target.ask("member", peer=honest.peer_id)

            def join_msg(h: Any, name: str) -> cm.Join:
                return cm.Join(addrs=[a.rsplit("/p2p/", 1)[0] for a in h.addrs()], throughput=100.0, name=name)

            await honest.request(coord_id, cm.COORDINATOR, join_msg(honest, "honest"), cm.JoinReply, timeout=30)
            beats = await stack.enter_async_context(trio.open_nursery())
            missed: list[str] = []

            async def keep_alive() -> None:
                # A node heartbeats in the background; a member that misses them all expires (attack 2's aim).
                while True:
                    try:
                        await honest.request(coord_id, cm.COORDINATOR, cm.Heartbeat(state="training", throughput=100.0),
                                             cm.HeartbeatReply, timeout=10)
                    except errors as err:
                        missed.append(str(err))
                    await trio.sleep(1.0)

            beats.start_soon(keep_alive)

            async def heartbeat() -> bool:
                reply = await honest.request(coord_id, cm.COORDINATOR, cm.Heartbeat(state="training", throughput=100.0),
                                             cm.HeartbeatReply, timeout=10)
                return reply.stage >= 0

            async def probe() -> bool:
                async with honest.open_stream(node_id, COLLECTIVE) as s:
                    await s.send(PartHeader(round=10**6, stage=STAGE, phase="probe", part=0))
                    return isinstance(await s.receive((Ack, Refuse, PartHeader), timeout=10), Ack)

            async def one_round() -> bool:
                return bool((await target.ask("round"))["ok"])

            tensor = torch.randn(512 * 1024, generator=torch.Generator().manual_seed(SEED))  # 2 MiB: over the lane

            async def send_tensor() -> bool:
                before = honest.bulk.stats.num_sent
                async with honest.open_stream(node_id, "sink") as s:
                    await s.send_tensor(to_frame(tensor))
                    await s.receive(Ack, timeout=10)
                return honest.bulk.stats.num_sent == before + 1  # and it went over the lane

            # -- idle streams -----------------------------------------------------------------
            async def idle_streams(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async with AsyncExitStack() as st:
                    hogs = await _hosts(st, sizes.identities, peers)
                    opened = [0]
                    first = trio.Event()

                    async def hold(h: Any, peer: str, proto: str) -> None:
                        for _ in range(10_000):  # reopen when cut: keep the slot taken
                            try:
                                async with h.open_stream(peer, proto) as s:
                                    opened[0] += 1
                                    if opened[0] >= total:
                                        first.set()
                                    await s.raw.read(1)  # returns or raises when the target cuts the stream
                            except errors:
                                opened[0] += 1
                                if opened[0] >= total:
                                    first.set()
                                await trio.sleep(0.2)

                    total = len(hogs) * sizes.idle_per_identity * 2
                    async with trio.open_nursery() as n:
                        for h in hogs:
                            for _ in range(sizes.idle_per_identity):
                                n.start_soon(hold, h, coord_id, cm.COORDINATOR)
                                n.start_soon(hold, h, node_id, COLLECTIVE)
                        with trio.move_on_after(20):
                            await first.wait()
                        task_status.started()

            results["idle_streams"] = await _measure(target, {"heartbeat": heartbeat, "probe": probe}, sizes, idle_streams)

            # -- trickle streams --------------------------------------------------------------
            async def trickle_streams(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                data = wire.frame(cm.Heartbeat(state="training")) + b"\x00" * 256
                async with AsyncExitStack() as st:
                    hogs = await _hosts(st, sizes.identities, peers)

                    async def drip(h: Any, peer: str, proto: str) -> None:
                        for _ in range(10_000):
                            try:
                                async with h.open_stream(peer, proto) as s:
                                    for i in range(len(data)):
                                        await s.raw.write(data[i : i + 1])
                                        await trio.sleep(1.0)
                            except errors:
                                await trio.sleep(0.2)

                    async with trio.open_nursery() as n:
                        for h in hogs:
                            for _ in range(sizes.trickles_per_identity):
                                n.start_soon(drip, h, coord_id, cm.COORDINATOR)
                                n.start_soon(drip, h, node_id, COLLECTIVE)
                        await trio.sleep(1.0)  # the trickles' first bytes are out
                        task_status.started()

            results["trickle_streams"] = await _measure(target, {"heartbeat": heartbeat, "probe": probe}, sizes, trickle_streams)

            # -- pre-round part flood -----------------------------------------------------------
            async def pre_round_flood(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                part = to_frame(torch.ones(sizes.numel))
                base = (await target.ask("next"))["next"]
                async with AsyncExitStack() as st:
                    (flooder,) = await _hosts(st, 1, peers)

                    async def send(k: int) -> None:
                        try:
                            async with flooder.open_stream(node_id, COLLECTIVE) as s:
                                # The next round and the one after (both may be held), and a stale one.
                                await s.send(PartHeader(round=base + k % 3, stage=STAGE, phase="scatter", part=k % 2))
                                await s.send_tensor(part)
                                await s.receive((Ack, Refuse), timeout=10)
                        except errors:
                            pass

                    for k in range(sizes.flood_parts):
                        await send(k)
                    task_status.started()
                    for k in range(10_000):  # and on, during the honest rounds
                        await send(k)

            results["pre_round_flood"] = await _measure(target, {"round": one_round}, sizes, pre_round_flood)

            # -- bulk lane: offers and hello slots ------------------------------------------------
            async def bulk_slots(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                header = TensorHeader(codec="none", dtype="float32", shape=[512 * 1024], data_bytes=2 * 1024 * 1024, bulk=True)
                lane_port = [0]
                async with AsyncExitStack() as st:
                    (hog,) = await _hosts(st, 1, peers)
                    asked = [0]
                    all_asked = trio.Event()

                    async def sit(k: int) -> None:
                        try:
                            async with hog.open_stream(node_id, "sink") as s:
                                await s.send(header)
                                reply = await s.receive((BulkOffer, BulkDecline), timeout=10)
                                if isinstance(reply, BulkOffer):
                                    lane_port[0] = reply.port
                                asked[0] += 1
                                if asked[0] == sizes.offers:
                                    all_asked.set()
                                await trio.sleep_forever()
                        except errors:
                            asked[0] += 1
                            if asked[0] == sizes.offers:
                                all_asked.set()

                    socks: list[trio.socket.SocketType] = []
                    async with trio.open_nursery() as n:
                        for k in range(sizes.offers):
                            n.start_soon(sit, k)
                        with trio.fail_after(20):
                            await all_asked.wait()
                        for _ in range(sizes.hellos if lane_port[0] else 0):
                            sock = trio.socket.socket()
                            socks.append(sock)
                            try:
                                await sock.bind(("127.0.0.2", 0))
                                await sock.connect(("127.0.0.1", lane_port[0]))
                            except OSError:
                                pass
                        task_status.started()
                        try:
                            await trio.sleep_forever()
                        finally:
                            for sock in socks:
                                sock.close()

            results["bulk_slots"] = await _measure(target, {"tensor": send_tensor}, sizes, bulk_slots)

            # -- bulk lane: threads held by trickling transfers -----------------------------------
            async def bulk_threads(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                header = TensorHeader(codec="none", dtype="float32", shape=[512 * 1024], data_bytes=2 * 1024 * 1024, bulk=True)
                async with AsyncExitStack() as st:
                    hogs = await _hosts(st, sizes.identities, peers)
                    dialled = [0]
                    enough = trio.Event()

                    async def hold_thread(h: Any) -> None:
                        for _ in range(10_000):
                            try:
                                async with h.open_stream(node_id, "sink") as s:
                                    await s.send(header)
                                    offer = await s.receive((BulkOffer, BulkDecline), timeout=10)
                                    if isinstance(offer, BulkDecline):
                                        await trio.sleep(1.0)
                                        continue
                                    sock = await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0)
                                    with sock:
                                        await s.send(BulkChoice(lane=True))
                                        dialled[0] += 1
                                        if dialled[0] >= len(hogs):
                                            enough.set()
                                        for _ in range(10_000):
                                            await trio.to_thread.run_sync(sock.send, b"\x00")
                                            await trio.sleep(1.0)
                            except errors:
                                await trio.sleep(0.2)

                    async with trio.open_nursery() as n:
                        for h in hogs:
                            for _ in range(6):  # more than the per-peer limit of 4
                                n.start_soon(hold_thread, h)
                        with trio.move_on_after(20):
                            await enough.wait()
                        task_status.started()

            results["bulk_threads"] = await _measure(target, {"tensor": send_tensor}, sizes, bulk_threads)

            # -- Sybil joins, then view churn ------------------------------------------------------
            sybil_stack = await stack.enter_async_context(AsyncExitStack())
            sybils = await _hosts(sybil_stack, sizes.sybils, peers)

            async def fresh_join() -> bool:
                async with AsyncExitStack() as st:  # a new honest node: its own identity and connection
                    (fresh,) = await _hosts(st, 1, peers)
                    reply = await fresh.request(coord_id, cm.COORDINATOR, join_msg(fresh, "fresh"), cm.JoinReply, timeout=30)
                    await fresh.request(coord_id, cm.COORDINATOR, cm.Leave(reason="bench"), cm.LeaveReply, timeout=10)
                    return reply.stage >= 0

            async def join_flood(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async def join(h: Any) -> None:
                    try:
                        await h.request(coord_id, cm.COORDINATOR, join_msg(h, "sybil"), cm.JoinReply, timeout=30)
                    except errors:
                        pass

                async with trio.open_nursery() as n:  # all at once, while the honest ops run
                    for h in sybils:
                        n.start_soon(join, h)
                    task_status.started()
                await trio.sleep_forever()

            results["join_flood"] = await _measure(target, {"heartbeat": heartbeat, "join": fresh_join}, sizes, join_flood)

            async def view_flood(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async def churn(h: Any, k: int) -> None:
                    for i in range(10_000):
                        try:
                            if (i + k) % 3 == 0:
                                await h.request(coord_id, cm.COORDINATOR, cm.Leave(reason="churn"), cm.LeaveReply, timeout=10)
                                await h.request(coord_id, cm.COORDINATOR, join_msg(h, "sybil"), cm.JoinReply, timeout=10)
                            else:
                                state = "training" if i % 2 else "averaging"
                                await h.request(coord_id, cm.COORDINATOR, cm.Heartbeat(state=state), cm.HeartbeatReply, timeout=10)
                        except errors:
                            await trio.sleep(0.05)

                async with trio.open_nursery() as n:
                    for k, h in enumerate(sybils):
                        n.start_soon(churn, h, k)
                    await trio.sleep(0.5)
                    task_status.started()

            results["view_flood"] = await _measure(target, {"heartbeat": heartbeat}, sizes, view_flood)
            beats.cancel_scope.cancel()
    finally:
        with trio.move_on_after(10):
            if proc.stdin is not None:
                try:
                    await proc.stdin.send_all(b'{"cmd": "stop"}\n')
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return {"mem_measure": "target process RSS (VmRSS), end of attack minus before", "attacks": results,
            "background_heartbeats_missed": len(missed),
            "all_honest_ok": all(r["honest_ok"] for r in results.values())}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py abuse")
    parser.add_argument("--quick", action="store_true", help="small counts (for tests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # the attackers' own failed dials and streams
    with tempfile.TemporaryDirectory(prefix="protolearn-abuse-") as workdir:
        return trio.run(main, QUICK if args.quick else Sizes(), workdir)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--numel", type=int, required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(_target, a.target, a.numel)
