"""The stream-level attacks: identities that open, hold and trickle streams, and flood parts, lanes and joins.

Each attack runs from this process against :mod:`.node_target` while an honest peer works:
``idle_streams`` (5 identities each open 24 idle streams on the coordinator's and the collective protocol
and reopen them when cut); ``trickle_streams`` (5 identities x 8 streams sending a request one byte a
second); ``pre_round_flood`` (a non-member sends 40 parts of the full vector for the next rounds; honest
op: a real 2-member round); ``bulk_slots`` (one identity asks for 12 lane offers and sits on them, and 60
silent lane connections come from 127.0.0.2); ``bulk_threads`` (5 identities dial every offer they get
and trickle a byte a second); ``join_flood`` (40 Sybil identities join at once; honest ops: heartbeat,
and a fresh honest join); ``view_flood`` (the Sybils leave and rejoin and flip their state without
pause, churning the view; honest op: heartbeat). ``--quick`` shrinks every count.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import trio

from abuse_bench.harness import SEED, Op, Sizes, Target, hosts, measure, quiet, split_addr
from abuse_bench.node_target import STAGE


async def _measure(target: Target, ops: dict[str, Op], sizes: Sizes, attack: Any) -> dict:
    n = sizes.rounds if "round" in ops else sizes.honest_ops
    return await measure(target, ops, n, sizes.window_s, attack)


async def run_stream_attacks(target: Target, ready: dict, sizes: Sizes) -> tuple[dict[str, dict], int]:
    """Every stream attack against ``target`` (``ready``: what it said once it listened); (rows, background
    heartbeats the honest peer missed)."""
    import torch

    from protolearn.protocol import coordination as cm
    from protolearn.protocol import wire
    from protolearn.protocol.collective import PartHeader
    from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse
    from protolearn.protocol.tensors import to_frame
    from protolearn.protocol.transport import TensorHeader
    from protolearn.protocol.transport.bulk_offers import BulkChoice, BulkDecline, BulkOffer
    from protolearn.protocol.transport.seal import dial

    errors = quiet()
    coord_addr, coord_id = split_addr(ready["coord"])
    node_id = ready["node_id"]
    peers = {coord_id: coord_addr, node_id: split_addr(ready["node"])[0]}
    results: dict[str, dict] = {}
    async with AsyncExitStack() as stack:
        (honest,) = await hosts(stack, 1, peers)
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
                hogs = await hosts(st, sizes.identities, peers)
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
                hogs = await hosts(st, sizes.identities, peers)

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
                (flooder,) = await hosts(st, 1, peers)

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
                (hog,) = await hosts(st, 1, peers)
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
                hogs = await hosts(st, sizes.identities, peers)
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
        sybils = await hosts(sybil_stack, sizes.sybils, peers)

        async def fresh_join() -> bool:
            async with AsyncExitStack() as st:  # a new honest node: its own identity and connection
                (fresh,) = await hosts(st, 1, peers)
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
    return results, len(missed)
