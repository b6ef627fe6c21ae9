"""The bulk lane between real hosts on 127.0.0.1: large payloads over sealed TCP, fallback, hostile input."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import Identity
from protolearn.protocol.tensors import from_frame, to_frame
from protolearn.protocol.transport import FramedStream, Host, TensorHeader, TensorTrailer, TransportConfig, open_host
from protolearn.protocol.transport.bulk import HELLO_TIMEOUT_S, UNREACHABLE_S
from protolearn.protocol.transport.bulk_offers import BulkChoice, BulkOffer, Offer, OfferTable
from protolearn.protocol.transport.clock import MONOTONIC
from protolearn.protocol.transport.seal import CHUNK_BYTES, TAG_BYTES, dial, seal_chunks
from tests.support.ports import free_port

MiB = 1024 * 1024
CONFIG = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=5.0)
OFF = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=5.0, bulk=False)


class Sink:
    """A ``sink`` stream handler that keeps every tensor it receives and every error it raised."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.errors: list[ProtocolError] = []
        self.arrived = trio.Event()

    async def __call__(self, peer: str, s: FramedStream) -> None:
        try:
            frame = await s.receive_tensor(codec="none", dtype=torch.float32)
        except ProtocolError as err:
            self.errors.append(err)
            self.arrived.set()
            raise  # the host logs it as a rejection and resets the stream
        self.tensors.append(from_frame(frame, peer=peer, dtype=torch.float32, require_finite=True))
        self.arrived.set()

    async def wait(self) -> None:
        with trio.fail_after(15):
            await self.arrived.wait()
        self.arrived = trio.Event()


class FakeClock:
    """A transport clock (protocol/transport/clock.py) that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def _pair(
    stack: AsyncExitStack, sender_cfg: TransportConfig = CONFIG, receiver_cfg: TransportConfig = CONFIG, *, sender_clock: FakeClock | None = None
) -> tuple[Host, Host, Sink]:
    clock = MONOTONIC if sender_clock is None else sender_clock
    sender = await stack.enter_async_context(open_host(Identity.generate(), config=sender_cfg, clock=clock))
    receiver = await stack.enter_async_context(open_host(Identity.generate(), config=receiver_cfg))
    sender.add_peer_addrs(receiver.peer_id, receiver.addrs())
    sink = Sink()
    receiver.serve_stream("sink", sink)
    return sender, receiver, sink


async def _send(sender: Host, receiver: Host, sink: Sink, t: torch.Tensor) -> torch.Tensor:
    async with sender.open_stream(receiver.peer_id, "sink") as s:
        await s.send_tensor(to_frame(t))
    await sink.wait()
    return sink.tensors[-1]


def test_64_mib_tensor_goes_over_the_lane_bit_identical(run_trio):
    sent = torch.randn(16 * MiB, generator=torch.Generator().manual_seed(5))  # 64 MiB of float32
    small = torch.arange(1000, dtype=torch.float32)  # 4 KB: below bulk_min_bytes, stays in-stream

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack)
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            assert (sender.bulk.stats.num_sent, receiver.bulk.stats.num_received) == (1, 1)
            assert torch.equal(await _send(sender, receiver, sink, small), small)
            assert (sender.bulk.stats.num_sent, receiver.bulk.stats.num_received) == (1, 1)
            assert sender.bulk.stats.num_fallbacks == 0 and len(receiver.bulk.offers) == 0

    run_trio(main, timeout=90)


def test_unreachable_lane_falls_back_to_the_stream_and_is_skipped_afterwards(run_trio):
    sent = torch.randn(2 * MiB, generator=torch.Generator().manual_seed(6))  # 8 MiB
    clock = FakeClock()

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack, sender_clock=clock)
            assert sender.clock is clock and sender.bulk.clock is clock
            receiver.bulk.port = free_port()  # what its offers advertise: nothing listens there (as behind NAT)
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            assert sender.bulk.stats.num_fallbacks == 1 and receiver.bulk.stats.num_received == 0
            # The failed dial is remembered: the next tensor does not ask for the lane at all ...
            clock.advance(UNREACHABLE_S - 1)
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            assert sender.bulk.stats.num_fallbacks == 1 and sender.bulk.stats.num_sent == 0
            # ... until UNREACHABLE_S have passed on the transport's clock: then the lane is tried again.
            clock.advance(1)
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            assert sender.bulk.stats.num_fallbacks == 2 and sender.bulk.stats.num_sent == 0
            assert len(receiver.bulk.offers) == 0

    run_trio(main, timeout=60)


def test_a_lane_address_that_reaches_some_other_service_falls_back(run_trio):
    """Behind NAT the offered port may be another machine's: no valid confirmation, so no lane."""
    sent = torch.randn(MiB, generator=torch.Generator().manual_seed(13))
    impatient = CONFIG.model_copy(update={"bulk_connect_timeout_s": 0.5})
    clock = FakeClock()

    async def impostor(listener: trio.socket.SocketType, answer: bytes) -> None:
        while True:
            conn, _ = await listener.accept()
            with conn:
                await conn.recv(16)
                if answer:
                    await conn.send(answer)
                # Keeps the connection open and says nothing more, until the test is done with it:
                # only the sender's own dial deadline can end its wait for a confirmation.
                await trio.sleep_forever()

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack, sender_cfg=impatient, sender_clock=clock)
            for k, answer in enumerate([b"HTTP/1.1 400 Bad", b""]):  # a wrong confirmation, then silence
                with trio.socket.socket() as listener:
                    await listener.bind(("127.0.0.1", 0))
                    listener.listen(4)
                    receiver.bulk.port = listener.getsockname()[1]
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(impostor, listener, answer)
                        t0 = trio.current_time()
                        assert torch.equal(await _send(sender, receiver, sink, sent), sent)
                        # The dial deadline (0.5 s, guarded by 1 s more) ends the wait, not the impostor;
                        # the margin is for a loaded 2-core machine, the failure it catches is a hang.
                        assert trio.current_time() - t0 < 0.5 + 1.0 + 5.0
                        nursery.cancel_scope.cancel()
                assert sender.bulk.stats.num_fallbacks == k + 1 and sender.bulk.stats.num_sent == 0
                clock.advance(UNREACHABLE_S)  # the failed lane's mark expires, so the lane is tried again

    run_trio(main, timeout=60)


@pytest.mark.parametrize("off", ["receiver", "sender"])
def test_lane_off_on_one_side_still_delivers_in_stream(run_trio, off):
    sent = torch.randn(2 * MiB, generator=torch.Generator().manual_seed(7))

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(
                stack, sender_cfg=OFF if off == "sender" else CONFIG, receiver_cfg=OFF if off == "receiver" else CONFIG
            )
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            on = receiver if off == "sender" else sender
            assert (sender if off == "sender" else receiver).bulk is None
            assert on.bulk.stats.num_sent == on.bulk.stats.num_received == 0
            # A declined offer counts as a fallback on the sender; a sender without a lane never asks.
            assert on.bulk.stats.num_fallbacks == (1 if off == "receiver" else 0)

    run_trio(main, timeout=60)


def test_hostile_connections_to_the_lane_are_closed_and_good_transfers_go_on(run_trio):
    sent = torch.randn(MiB, generator=torch.Generator().manual_seed(8))

    async def hostile(ip: str, port: int, payload: bytes) -> float:
        """Connect, send ``payload``, return how long until the lane closed the connection."""
        with trio.socket.socket() as sock:
            await sock.connect((ip, port))
            if payload:
                await sock.send(payload)
            t0 = trio.current_time()
            with trio.fail_after(HELLO_TIMEOUT_S + 5):
                while True:
                    try:
                        if not await sock.recv(4096):
                            break
                    except ConnectionResetError:
                        break
            return trio.current_time() - t0

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack)
            lane = receiver.bulk
            waits: dict[str, float] = {}

            async def one(name: str, payload: bytes) -> None:
                waits[name] = await hostile(lane.ip, lane.port, payload)

            async with trio.open_nursery() as nursery:  # all at once: one slow client must not hold up others
                nursery.start_soon(one, "silent", b"")
                nursery.start_soon(one, "wrong token", b"\x00" * 16)
                nursery.start_soon(one, "garbage", bytes(range(256)) * 40)
                nursery.start_soon(one, "short", b"abc")
            # Refused at once, i.e. well before the hello deadline (the margin is for a loaded machine) ...
            assert waits["wrong token"] < HELLO_TIMEOUT_S - 0.5 and waits["garbage"] < HELLO_TIMEOUT_S - 0.5, waits
            # ... while a silent or short client is closed at the hello deadline, and not before it.
            assert HELLO_TIMEOUT_S - 0.5 < waits["silent"] < HELLO_TIMEOUT_S + 5, waits
            assert HELLO_TIMEOUT_S - 0.5 < waits["short"] < HELLO_TIMEOUT_S + 5, waits
            assert lane.stats.num_refused == 4
            assert any("not a pending offer" in r for r in lane.stats.refused_reasons)
            assert torch.equal(await _send(sender, receiver, sink, sent), sent)
            assert lane.stats.num_received == 1

    run_trio(main, timeout=60)


def _flip_byte(wire: bytes) -> list[bytes]:
    b = bytearray(wire)
    b[CHUNK_BYTES + TAG_BYTES + 100] ^= 1  # a byte of the second chunk
    return [bytes(b)]


def _swap_chunks(wire: bytes) -> list[bytes]:
    n = CHUNK_BYTES + TAG_BYTES
    return [wire[n : 2 * n] + wire[:n] + wire[2 * n :]]


def _truncate(wire: bytes) -> list[bytes]:
    return [wire[: len(wire) // 2]]  # then the sender closes the connection


def _end_writes(sock: socket.socket) -> None:
    """Half-close our side (a cut payload then reads as EOF), unless the receiver already hung up.

    A receiver that found a bad chunk closes the connection with our later chunks still unread, so
    its kernel answers with a reset: our socket is then no longer connected and ``shutdown`` raises
    ENOTCONN (or a ConnectionError). That is the receiver doing its job, not a failure of the test.
    """
    try:
        sock.shutdown(socket.SHUT_WR)
    except ConnectionError:
        pass
    except OSError as err:
        if err.errno != errno.ENOTCONN:
            raise


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [(_flip_byte, "failed authentication"), (_swap_chunks, "failed authentication"), (_truncate, "ended mid-tensor")],
)
def test_tampered_or_truncated_lane_bytes_are_a_protocol_error_naming_the_peer(run_trio, mangle: Callable[[bytes], list[bytes]], reason: str):
    t = torch.randn(3 * MiB // 4, generator=torch.Generator().manual_seed(9))  # 3 MiB: three sealed chunks

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack)
            frame = to_frame(t)
            async with sender.open_stream(receiver.peer_id, "sink") as s:
                header = TensorHeader(codec="none", dtype="float32", shape=frame.shape, data_bytes=len(frame.data), bulk=True)
                await s.send(header)
                offer = await s.receive(BulkOffer)
                # Seal the payload correctly, then mangle it on its way.
                wire = b"".join(bytes(c) for c in seal_chunks(offer.key, memoryview(frame.data)))
                sock = await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0)
                with sock:
                    await s.send(BulkChoice(lane=True))
                    try:
                        for piece in mangle(wire):
                            await trio.to_thread.run_sync(sock.sendall, piece)
                    except ConnectionError:
                        pass  # the receiver may hang up at the first bad chunk while we still write
                    _end_writes(sock)
                    await sink.wait()
            assert len(sink.errors) == 1 and not sink.tensors
            err = sink.errors[0]
            assert err.peer == sender.peer_id and reason in err.reason
            rejection = receiver.gate.recent[-1]
            assert rejection.peer == sender.peer_id and reason in rejection.reason
            # The receiver keeps serving: a good transfer over the lane works right after.
            assert torch.equal(await _send(sender, receiver, sink, t), t)
            assert receiver.bulk.stats.num_received == 1

    run_trio(main, timeout=60)


def test_offer_table_bounds_offers_and_reserved_bytes_and_claims_once():
    table = OfferTable(max_pending=2, max_bytes=250, ttl_s=10.0)
    first = table.create("p", 100, now=0.0)
    second = table.create("p", 100, now=1.0)
    assert isinstance(first, Offer) and isinstance(second, Offer) and first.token != second.token and first.key != second.key
    refused = table.create("p", 10, now=2.0)
    assert isinstance(refused, str) and "limit is 2" in refused
    offer, _ = table.claim(first.token, now=3.0)
    assert offer is first
    assert table.claim(first.token, now=3.0) == (None, "token is not a pending offer")  # once only
    assert table.claim(second.token, now=11.5)[0] is None  # expired at 11.0, its bytes freed
    assert table.reserved_bytes == 100 and len(table) == 1  # the claimed one holds its buffer until released
    too_big = table.create("p", 151, now=12.0)
    assert isinstance(too_big, str) and "exceed the limit of 250" in too_big
    table.release(first.token)
    assert table.reserved_bytes == 0 and isinstance(table.create("p", 250, now=12.0), Offer)


def test_trailer_still_guards_a_lane_transfer(run_trio):
    """A lane payload followed by a trailer with the wrong count is refused, naming the peer."""
    t = torch.randn(MiB // 2, generator=torch.Generator().manual_seed(10))  # 2 MiB

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack)
            frame = to_frame(t)
            async with sender.open_stream(receiver.peer_id, "sink") as s:
                await s.send(TensorHeader(codec="none", dtype="float32", shape=frame.shape, data_bytes=len(frame.data), bulk=True))
                offer = await s.receive(BulkOffer)
                sock = await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0)
                await s.send(BulkChoice(lane=True))
                await sender.bulk.send(sock, offer.key, memoryview(frame.data), peer=receiver.peer_id, chunk_timeout=5.0)
                await s.send(TensorTrailer(data_bytes=len(frame.data) - 4))
                await sink.wait()
            assert len(sink.errors) == 1 and sink.errors[0].peer == sender.peer_id
            assert "trailer" in sink.errors[0].reason

    run_trio(main, timeout=60)


def test_a_sender_that_stalls_on_the_lane_is_timed_out_per_chunk(run_trio):
    """A live connection that stops mid-chunk costs the receiver one chunk deadline, not a hang."""
    cfg = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=1.5, connect_timeout_s=5.0)
    t = torch.randn(MiB, generator=torch.Generator().manual_seed(11))  # 4 MiB: four chunks

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack, receiver_cfg=cfg)
            frame = to_frame(t)
            async with sender.open_stream(receiver.peer_id, "sink") as s:
                await s.send(TensorHeader(codec="none", dtype="float32", shape=frame.shape, data_bytes=len(frame.data), bulk=True))
                offer = await s.receive(BulkOffer)
                wire = b"".join(bytes(c) for c in seal_chunks(offer.key, memoryview(frame.data)))
                with await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0) as sock:
                    await s.send(BulkChoice(lane=True))
                    await trio.to_thread.run_sync(sock.sendall, wire[: CHUNK_BYTES + 1000])  # then nothing, socket open
                    t0 = trio.current_time()
                    await sink.wait()
                    waited = trio.current_time() - t0
            err = sink.errors[0]
            assert err.peer == sender.peer_id and "not complete within 1.5 s" in err.reason
            # One chunk deadline (1.5 s, which started when chunk 0 was in, a little before t0), not a
            # hang; the upper margin is for a loaded 2-core machine.
            assert 0.5 < waited < 1.5 + 5.0, waited
            assert torch.equal(await _send(sender, receiver, sink, t), t)

    run_trio(main, timeout=60)


def test_a_cancelled_receive_closes_its_lane_connection_at_once(run_trio):
    """A handler that gives up mid-transfer (its own deadline) drops the connection; the host goes on."""
    t = torch.randn(MiB, generator=torch.Generator().manual_seed(12))
    gave_up = trio.Event()

    async def impatient(peer: str, s: FramedStream) -> None:
        with trio.move_on_after(0.5):
            await s.receive_tensor(codec="none", dtype=torch.float32)
        gave_up.set()

    async def main():
        async with AsyncExitStack() as stack:
            sender, receiver, sink = await _pair(stack)
            receiver.serve_stream("impatient", impatient)
            frame = to_frame(t)
            async with sender.open_stream(receiver.peer_id, "impatient") as s:
                await s.send(TensorHeader(codec="none", dtype="float32", shape=frame.shape, data_bytes=len(frame.data), bulk=True))
                offer = await s.receive(BulkOffer)
                wire = b"".join(bytes(c) for c in seal_chunks(offer.key, memoryview(frame.data)))
                with await trio.to_thread.run_sync(dial, "127.0.0.1", offer.port, offer.token, offer.key, 5.0) as sock:
                    await s.send(BulkChoice(lane=True))
                    await trio.to_thread.run_sync(sock.sendall, wire[:1000])
                    with trio.fail_after(5):
                        await gave_up.wait()
                    sock.settimeout(10.0)  # the failure this catches is a connection left open for good
                    assert await trio.to_thread.run_sync(sock.recv, 16) == b""  # closed by the receiver, not left open
            assert len(receiver.bulk.offers) == 0
            assert torch.equal(await _send(sender, receiver, sink, t), t)
            assert receiver.bulk.stats.num_received == 1

    run_trio(main, timeout=60)
