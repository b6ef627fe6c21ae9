"""Per-peer limits on real loopback hosts, driven the way an attacker would (issue 12, attacks 2 and 9).

Each test runs an attack from hostile identities against a served host while an honest peer uses
it, and checks that the attackers are capped by *their own* limits (recorded at the gate, naming the
peer and the reason) while the honest peer is served. Waits on the server's state poll cheap,
in-process counters under a deadline; the attackers' pauses are their attack's pace, not syncing.
"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from typing import ClassVar

import pytest
import torch
import trio

from libp2p.exceptions import BaseLibp2pError

from protolearn.node.averaging import Averager
from protolearn.protocol import wire
from protolearn.protocol.collective import PartHeader
from protolearn.protocol.errors import PeerTimeout, ProtocolError
from protolearn.protocol.identity import Identity
from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse
from protolearn.protocol.tensors import from_frame, to_frame
from protolearn.protocol.transport import FramedStream, Host, TensorHeader, TransportConfig, open_host
from protolearn.protocol.transport.bulk_offers import BulkDecline, BulkOffer
from protolearn.protocol.wire import Message
from tests.support.waiting import wait_until

MiB = 1024 * 1024


class Ping(Message):
    KIND: ClassVar[str] = "test_limits_ping"
    n: int


class Pong(Message):
    KIND: ClassVar[str] = "test_limits_pong"
    n: int


async def pong(peer: str, req: Message) -> Message:
    assert isinstance(req, Ping)
    return Pong(n=req.n + 1)


async def honest_requests(client: Host, server: Host, n: int) -> list[int]:
    return [(await client.request(server.peer_id, "ping", Ping(n=i), Pong, timeout=10)).n for i in range(n)]


async def hold_idle(attacker: Host, server: Host) -> None:
    """Open a stream and never send: the slot stays taken until the server lets it go."""
    try:
        async with attacker.open_stream(server.peer_id, "ping") as s:
            await trio.sleep_forever()
            del s
    except ProtocolError:
        pass  # refused (reset) by the server: that is the point


def test_idle_stream_hogs_are_capped_per_peer_and_the_honest_peer_is_served(open_hosts, run_trio):
    # A protocol with 12 slots; per peer 3. Idle streams live 20 s here, longer than the test.
    cfg = TransportConfig(request_timeout_s=20.0, chunk_timeout_s=5.0, connect_timeout_s=5.0, message_deadline_s=20.0,
                          max_inbound_streams_per_peer=3, abuse_threshold=1000)

    async def main():
        async with open_hosts(5, cfg) as (server, honest, *attackers):
            server.serve("ping", pong, request_type=Ping, max_inbound=12)
            async with trio.open_nursery() as nursery:
                for a in attackers:
                    for _ in range(6):  # twice what one peer may hold
                        nursery.start_soon(hold_idle, a, server)
                await wait_until(lambda: server.gate.rejected["stream_limit"] >= 9 and server.active_streams("ping") == 9,
                               "each attacker at its limit and its extra streams refused", timeout=15.0)
                for a in attackers:
                    assert server.active_streams("ping", a.peer_id) == 3
                # Three identities hold 9 of 12 slots; before per-peer limits they held all 12.
                assert await honest_requests(honest, server, 5) == [1, 2, 3, 4, 5]
                refused = [r for r in server.gate.recent if r.kind == "stream_limit"]
                assert {r.peer for r in refused} == {a.peer_id for a in attackers}
                assert all("peer over its limit of 3 concurrent inbound streams" in r.reason for r in refused)
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_repeated_limit_abuse_bans_the_peer_for_a_while_and_others_go_on(open_hosts, run_trio):
    cfg = TransportConfig(request_timeout_s=20.0, chunk_timeout_s=5.0, connect_timeout_s=5.0, message_deadline_s=20.0,
                          max_inbound_streams_per_peer=2, abuse_threshold=8, abuse_window_s=60.0, temp_ban_s=600.0)

    async def main():
        async with open_hosts(3, cfg) as (server, honest, attacker):
            server.serve("ping", pong, request_type=Ping, max_inbound=64)
            async with trio.open_nursery() as nursery:
                for _ in range(12):
                    nursery.start_soon(hold_idle, attacker, server)
                await wait_until(lambda: server.ban_reason(attacker.peer_id) is not None, "the attacker's temporary ban", timeout=15.0)
                # Banned: its connection is closed, and it holds nothing.
                await wait_until(lambda: server.active_streams("ping", attacker.peer_id) == 0, "the banned peer's streams to end", timeout=15.0)
                assert server.gate.abuse.num_bans == 1 and server.ban_reason(honest.peer_id) is None
                assert "temporarily banned for 600 s" in server.ban_reason(attacker.peer_id)
                assert not server.is_banned(attacker.peer_id)  # temporary only: no permanent ban
                with pytest.raises(ProtocolError):
                    await attacker.request(server.peer_id, "ping", Ping(n=1), Pong, timeout=5)
                assert await honest_requests(honest, server, 3) == [1, 2, 3]
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


async def trickle(s: FramedStream, data: bytes, pace_s: float = 1.0) -> bool:
    """Send ``data`` one byte per ``pace_s``: each read is quick, the whole never arrives in time.
    True when the server cut the stream off before it was all sent."""
    for i in range(len(data)):
        try:
            await s.raw.write(data[i : i + 1])
        except (BaseLibp2pError, OSError):
            return True
        await trio.sleep(pace_s)
    return False


def test_a_trickle_is_cut_off_by_the_whole_message_deadline_and_the_honest_peer_is_served(open_hosts, run_trio):
    # Per-read deadlines of 8 s would never fire on a byte a second; the whole-message deadline does.
    cfg = TransportConfig(request_timeout_s=8.0, chunk_timeout_s=8.0, connect_timeout_s=5.0, message_deadline_s=2.0,
                          min_rate_bytes_per_s=64 * 1024)
    cut: dict[str, tuple[float, ProtocolError]] = {}

    async def main():
        async with open_hosts(3, cfg) as (server, honest, attacker):
            server.serve("ping", pong, request_type=Ping)
            started: dict[str, float] = {}

            async def sink(peer: str, s: FramedStream) -> None:
                try:
                    frame = await s.receive_tensor(codec="none", dtype=torch.float32)
                except PeerTimeout as err:
                    cut[peer] = (trio.current_time() - started.get(peer, trio.current_time()), err)
                    raise
                await s.send(Pong(n=int(from_frame(frame, peer=peer, dtype=torch.float32).numel())))

            server.serve_stream("sink", sink)

            async def trickle_tensor() -> None:
                async with attacker.open_stream(server.peer_id, "sink") as s:
                    await s.send(TensorHeader(codec="none", dtype="float32", shape=[1024], data_bytes=4096))
                    started[attacker.peer_id] = trio.current_time()
                    assert await trickle(s, b"\x00" * 4096)  # 4096 s at this pace, unless cut off

            async def trickle_request() -> None:
                async with attacker.open_stream(server.peer_id, "ping") as s:
                    assert await trickle(s, wire.frame(Ping(n=1)) + b"\x00" * 64)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle_tensor)
                nursery.start_soon(trickle_request)
                # The honest peer is served while both trickles run.
                assert await honest_requests(honest, server, 3) == [1, 2, 3]
                async with honest.open_stream(server.peer_id, "sink") as s:
                    await s.send_tensor(to_frame(torch.ones(1000)))
                    assert (await s.receive(Pong)).n == 1000
                await wait_until(lambda: server.gate.rejected["PeerTimeout"] >= 2, "both trickles cut off", timeout=15.0)
            waited, err = cut[attacker.peer_id]
            assert err.peer == attacker.peer_id and "not complete within 2 s" in err.reason and "too slow" in err.reason
            assert 1.5 < waited < 2.0 + 5.0, waited  # bounded by the 2 s deadline (+ a loaded machine's margin)
            reasons = [r.reason for r in server.gate.recent if r.peer == attacker.peer_id]
            assert any("no complete message within 2 s on ping" in r for r in reasons), reasons

    run_trio(main, timeout=60)


NUMEL = 64 * 1024  # a 256 KiB stage vector: parts travel in-stream


async def flood_parts(attacker: Host, node: Host, num: int, round_id: int) -> dict[str, int]:
    """Send ``num`` full-size scatter parts for ``round_id``; count how the node answered."""
    counts = {"ack": 0, "refused": 0}
    part = to_frame(torch.ones(NUMEL))
    for k in range(num):
        try:
            async with attacker.open_stream(node.peer_id, COLLECTIVE) as s:
                await s.send(PartHeader(round=round_id, stage=1, phase="scatter", part=k % 4))
                await s.send_tensor(part)
                reply = await s.receive((Ack, Refuse))
            counts["ack" if isinstance(reply, Ack) else "refused"] += 1
        except ProtocolError:
            counts["refused"] += 1  # reset after the header: over its limit
    return counts


@pytest.mark.parametrize("with_view", [True, False], ids=["view", "no-view"])
def test_a_non_member_flooding_early_parts_is_held_to_its_bound_and_the_round_still_works(open_hosts, run_trio, with_view):
    vector_bytes = 4 * NUMEL

    async def main():
        async with open_hosts(3) as (node, member, attacker):
            members = {node.peer_id, member.peer_id}
            view = (lambda: members) if with_view else None
            a_node = Averager(node, 1, NUMEL, timeout_s=20.0, first_round=3, members=view)
            a_member = Averager(member, 1, NUMEL, timeout_s=20.0, first_round=3)
            a_node.register()
            a_member.register()
            counts = await flood_parts(attacker, node, 40, round_id=3)
            counts2 = await flood_parts(attacker, node, 10, round_id=4)
            held = a_node._early.peer_held(attacker.peer_id)
            bound = vector_bytes if with_view else 2 * vector_bytes
            assert held <= bound and a_node._early.held_bytes <= 4 * vector_bytes
            assert counts["ack"] + counts2["ack"] == held // vector_bytes and counts["refused"] >= 38
            over = [r for r in node.gate.recent if r.kind == "OverLimit"]
            assert over and all(r.peer == attacker.peer_id and "early part" in r.reason for r in over)
            # The members' round goes through, the flood's parts are left out.
            weights = {node.peer_id: 1.0, member.peer_id: 1.0}
            out: dict[str, torch.Tensor] = {}

            async def one(a: Averager, v: float) -> None:
                out[a.host.peer_id] = await a.run_round(3, weights, torch.full((NUMEL,), v))

            async with trio.open_nursery() as n:
                n.start_soon(one, a_node, 1.0)
                n.start_soon(one, a_member, 2.0)
            assert torch.equal(out[node.peer_id], torch.full((NUMEL,), 3.0))
            assert torch.equal(out[member.peer_id], out[node.peer_id])
            assert a_node._early.peer_held(attacker.peer_id) <= bound  # round 4's, within the bound

    run_trio(main, timeout=90)


def test_sybils_outside_the_stage_share_a_quarter_of_the_collective_slots_and_a_member_gets_in(open_hosts, run_trio):
    cfg = TransportConfig(request_timeout_s=20.0, chunk_timeout_s=5.0, connect_timeout_s=5.0, message_deadline_s=20.0,
                          abuse_threshold=1000)

    async def main():
        async with open_hosts(6, cfg) as (node, member, *sybils):
            members = {node.peer_id, member.peer_id}
            Averager(node, 1, NUMEL, timeout_s=20.0, members=lambda: members).register()

            async def hold(h: Host) -> None:
                try:
                    async with h.open_stream(node.peer_id, COLLECTIVE) as s:
                        await trio.sleep_forever()
                        del s
                except ProtocolError:
                    pass

            async with trio.open_nursery() as nursery:
                for h in sybils:  # 4 identities x 8 streams: each within its per-peer limit of 8
                    for _ in range(8):
                        nursery.start_soon(hold, h)
                await wait_until(lambda: node.active_streams(COLLECTIVE) == 16 and node.gate.rejected["stream_limit"] >= 16,
                               "the outsiders' 16 slots full and the rest refused", timeout=15.0)
                refused = [r for r in node.gate.recent if r.kind == "stream_limit"]
                assert all("unknown peers hold their limit of 16" in r.reason for r in refused)
                # A member of the stage still gets its streams (48 slots are left for members).
                for _ in range(3):
                    async with member.open_stream(node.peer_id, COLLECTIVE) as s:
                        await s.send(PartHeader(round=10**6, stage=1, phase="probe", part=0))
                        assert isinstance(await s.receive((Ack, Refuse, PartHeader), timeout=10), Ack)
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


BULK_CFG = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=5.0,
                           bulk_max_pending_per_peer=2, bulk_max_hellos_per_ip=4)


class Sink:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    async def __call__(self, peer: str, s: FramedStream) -> None:
        frame = await s.receive_tensor(codec="none", dtype=torch.float32)
        self.tensors.append(from_frame(frame, peer=peer, dtype=torch.float32))
        await s.send(Ack())


def test_one_peer_cannot_hold_more_than_its_bulk_lane_offers_or_one_ips_hello_slots(run_trio):
    t = torch.randn(MiB // 2, generator=torch.Generator().manual_seed(12))  # 2 MiB: over bulk_min_bytes

    async def main():
        async with AsyncExitStack() as stack:
            receiver = await stack.enter_async_context(open_host(Identity.generate(), config=BULK_CFG))
            honest = await stack.enter_async_context(open_host(Identity.generate(), config=BULK_CFG))
            attacker = await stack.enter_async_context(open_host(Identity.generate(), config=BULK_CFG))
            for h in (honest, attacker):
                h.add_peer_addrs(receiver.peer_id, receiver.addrs())
            sink = Sink()
            receiver.serve_stream("sink", sink)
            lane = receiver.bulk
            answers: list[Message] = []
            all_in = trio.Event()

            async def ask_lane() -> None:
                # Ask for the lane, then sit on the offer: it reserves a buffer and, once dialled, a thread.
                async with attacker.open_stream(receiver.peer_id, "sink") as s:
                    await s.send(TensorHeader(codec="none", dtype="float32", shape=[MiB // 2], data_bytes=2 * MiB, bulk=True))
                    answers.append(await s.receive((BulkOffer, BulkDecline)))
                    if len(answers) == 6:
                        all_in.set()
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(ask_lane)
                with trio.fail_after(15):
                    await all_in.wait()
                offers = [a for a in answers if isinstance(a, BulkOffer)]
                declines = [a for a in answers if isinstance(a, BulkDecline)]
                assert len(offers) == 2 and len(declines) == 4
                assert all("peer has 2 bulk transfers pending, its limit is 2" in d.reason for d in declines)
                assert receiver.gate.rejected["bulk_limit"] == 4
                assert all(r.peer == attacker.peer_id for r in receiver.gate.recent if r.kind == "bulk_limit")

                # Pre-token slots: one IP (127.0.0.2, another loopback address) opens 10 silent connections.
                silent: list[trio.socket.SocketType] = []
                for _ in range(10):
                    sock = trio.socket.socket()
                    await sock.bind(("127.0.0.2", 0))
                    await sock.connect((lane.ip, lane.port))
                    silent.append(sock)
                await wait_until(lambda: lane.stats.num_refused >= 6, "the connections over the per-IP hello limit closed", timeout=15.0)
                assert sum("connections from 127.0.0.2 waiting" in r for r in lane.stats.refused_reasons) == 6

                # The honest peer's transfer still goes over the lane, while the attacker holds its share.
                async with honest.open_stream(receiver.peer_id, "sink") as s:
                    await s.send_tensor(to_frame(t))
                    await s.receive(Ack)
                assert torch.equal(sink.tensors[-1], t)
                assert lane.stats.num_received == 1 and honest.bulk.stats.num_fallbacks == 0
                for sock in silent:
                    sock.close()
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_trickle_on_the_bulk_lane_frees_its_thread_at_the_whole_transfer_deadline(run_trio):
    cfg = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=8.0, connect_timeout_s=5.0, message_deadline_s=2.0,
                          min_rate_bytes_per_s=16 * MiB)
    from protolearn.protocol.transport.bulk_offers import BulkChoice
    from protolearn.protocol.transport.seal import dial

    async def main():
        async with AsyncExitStack() as stack:
            receiver = await stack.enter_async_context(open_host(Identity.generate(), config=cfg))
            attacker = await stack.enter_async_context(open_host(Identity.generate(), config=cfg))
            attacker.add_peer_addrs(receiver.peer_id, receiver.addrs())
            errors: list[ProtocolError] = []

            async def sink(peer: str, s: FramedStream) -> None:
                try:
                    await s.receive_tensor(codec="none", dtype=torch.float32)
                except ProtocolError as err:
                    errors.append(err)
                    raise

            receiver.serve_stream("sink", sink)
            async with attacker.open_stream(receiver.peer_id, "sink") as s:
                await s.send(TensorHeader(codec="none", dtype="float32", shape=[MiB // 2], data_bytes=2 * MiB, bulk=True))
                offer = await s.receive(BulkOffer)
                with await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0) as sock:
                    await s.send(BulkChoice(lane=True))
                    t0 = trio.current_time()
                    with trio.fail_after(15):
                        while not errors:  # a byte a second: each chunk's 8 s deadline alone would never fire
                            await trio.to_thread.run_sync(sock.send, b"\x00")
                            await trio.sleep(1.0)
                    waited = trio.current_time() - t0
            assert errors[0].peer == attacker.peer_id and "not complete within 2 s" in errors[0].reason
            assert waited < 2.0 + 5.0, waited

    run_trio(main, timeout=60)


def _loopback_alias_works() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


if not _loopback_alias_works():  # pragma: no cover - Linux routes all of 127/8 to loopback
    pytestmark = pytest.mark.skip(reason="127.0.0.2 is not a loopback address here")
