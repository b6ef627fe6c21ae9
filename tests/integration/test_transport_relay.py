"""Circuit relay v2 between real hosts on 127.0.0.1: reservations, relayed requests, the relay's
limits (a peer over them is cut off, others keep being served), and who may open circuits and punches.

Loopback has no NAT, so here a "private" node is simply one whose peers were given only its relayed
address. Hole punching itself is tested across real NATs in network namespaces (tests/e2e/test_nat.py):
on loopback both sides' simultaneous dials use the same four-tuple (127.0.0.1:a <-> 127.0.0.1:b), so
one of them fails with EADDRNOTAVAIL and whether the punch works depends on which dial wins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest
import torch

from protolearn.protocol.errors import PeerUnavailable, ProtocolError, Refused
from protolearn.protocol.identity import Identity
from protolearn.protocol.relay_book import RelayLimits
from protolearn.protocol.tensors import to_frame
from protolearn.protocol.transport import FramedStream, Host, TransportConfig, open_host
from protolearn.protocol.transport.holepunch import DCUTR, DCUTR_PROTOCOL
from protolearn.protocol.transport.relay import HOP, STOP, STOP_PROTOCOL
from protolearn.protocol.wire import Message
from tests.support.waiting import wait_until

CONFIG = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=5.0)
MiB = 1024 * 1024


class Ping(Message):
    KIND = "test.relay.ping"
    n: int


class Pong(Message):
    KIND = "test.relay.pong"
    n: int


def serve_ping(host: Host) -> None:
    async def pong(peer: str, msg: Message) -> Message:
        assert isinstance(msg, Ping)
        return Pong(n=msg.n + 1)

    host.serve("ping", pong, request_type=Ping)


async def open_swarm(stack: AsyncExitStack, limits: RelayLimits, n: int) -> tuple[Host, list[Host]]:
    """A relay and ``n`` hosts that do not punch (so their paths stay relayed)."""
    relay = await stack.enter_async_context(open_host(Identity.generate(), config=CONFIG, relay=limits))
    hosts = [await stack.enter_async_context(open_host(Identity.generate(), config=CONFIG)) for _ in range(n)]
    for h in hosts:
        h.punch = False
    return relay, hosts


def test_a_private_node_is_reached_through_its_relay(run_trio: Callable[..., object]) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, (a, b) = await open_swarm(stack, RelayLimits(), 2)
            assert relay.relaying and not a.relaying
            circuit = await a.reserve(relay.addrs()[0], timeout=5)
            assert circuit == f"{relay.addrs()[0]}/p2p-circuit/p2p/{a.peer_id}"
            serve_ping(a)
            # b knows a only by its relayed address, as a peer of a NAT'd node does.
            b.add_peer_addrs(a.peer_id, [circuit])
            assert b.path_to(a.peer_id) is None
            replies = [(await b.request(a.peer_id, "ping", Ping(n=i), Pong)).n for i in range(3)]
            assert replies == [1, 2, 3]
            assert b.path_to(a.peer_id) == a.path_to(b.peer_id) == "relayed"
            assert relay.relay.book is not None and relay.relay.book.num_circuits == 1
            # The relay sees only the circuit, not the protolearn protocol inside it.
            assert relay.requests_served == 0

    run_trio(main)


def test_the_relay_is_full_until_a_holder_leaves(run_trio: Callable[..., object]) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, (a, b) = await open_swarm(stack, RelayLimits(max_reservations=1), 2)
            await a.reserve(relay.addrs()[0], timeout=5)
            await a.reserve(relay.addrs()[0], timeout=5)  # renewing one's own slot is fine
            with pytest.raises(Refused, match="RESERVATION_REFUSED"):
                await b.reserve(relay.addrs()[0], timeout=5)
            assert any(r.protocol == HOP for r in relay.gate.recent)
            # a leaves: its slot is free at once, not when its reservation would have lapsed.
            await a.disconnect(relay.peer_id)
            await wait_until(lambda: relay.path_to(a.peer_id) is None, "the relay to see a leave")
            await b.reserve(relay.addrs()[0], timeout=5)

    run_trio(main)


def test_a_circuit_over_its_bytes_is_cut_and_the_relay_serves_others(run_trio: Callable[..., object]) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, (a, b, c) = await open_swarm(stack, RelayLimits(max_circuit_bytes=2 * MiB), 3)
            circuit = await a.reserve(relay.addrs()[0], timeout=5)
            got: list[int] = []

            async def sink(peer: str, s: FramedStream) -> None:
                while True:
                    frame = await s.receive_tensor()
                    got.append(len(frame.data))

            a.serve_stream("sink", sink)
            serve_ping(a)
            b.add_peer_addrs(a.peer_id, [circuit])
            c.add_peer_addrs(a.peer_id, [circuit])
            frame = to_frame(torch.zeros(MiB // 4))  # 1 MiB
            with pytest.raises(ProtocolError):
                async with b.open_stream(a.peer_id, "sink") as s:
                    for _ in range(4):
                        await s.send_tensor(frame)
                    await wait_until(lambda: len(got) == 4, "4 MiB through a 2 MiB circuit")
            await wait_until(lambda: relay.relay.cut == 1, "the relay to cut the circuit")
            assert len(got) < 4
            await wait_until(lambda: b.path_to(a.peer_id) is None, "b's circuit to close")
            # Everyone else is still served: c reaches a through the same relay. When the relay resets the cut
            # circuit's stream to a, py-libp2p's yamux sometimes drops a's whole connection to the relay under load
            # (a window update fails on the reset stream; 2 of 8 runs with the cores kept busy), and a's
            # reservation with it: a node then reserves again (node/reachability.py), and so does a here.
            try:
                pong = await c.request(a.peer_id, "ping", Ping(n=7), Pong)
            except PeerUnavailable:
                assert relay.path_to(a.peer_id) is None, "the relay still held a's connection and refused c"
                await a.reserve(relay.addrs()[0], timeout=5)
                pong = await c.request(a.peer_id, "ping", Ping(n=7), Pong)
            assert pong.n == 8

    run_trio(main)


def test_circuits_per_peer_and_duration_are_limited(run_trio: Callable[..., object]) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, (a1, a2, b) = await open_swarm(stack, RelayLimits(max_circuits_per_peer=1, max_circuit_duration_s=1.5), 3)
            c1 = await a1.reserve(relay.addrs()[0], timeout=5)
            c2 = await a2.reserve(relay.addrs()[0], timeout=5)
            serve_ping(a1)
            serve_ping(a2)
            b.add_peer_addrs(a1.peer_id, [c1])
            b.add_peer_addrs(a2.peer_id, [c2])
            assert (await b.request(a1.peer_id, "ping", Ping(n=1), Pong)).n == 2
            # b's one circuit is taken: a second one, to another peer, is refused with the reason.
            with pytest.raises(ProtocolError, match="RESOURCE_LIMIT_EXCEEDED"):
                await b.request(a2.peer_id, "ping", Ping(n=1), Pong)
            # The first circuit is cut when its time is up, even though it is idle...
            await wait_until(lambda: b.path_to(a1.peer_id) is None, "the circuit's time to run out", timeout=8)
            # ...which frees b's slot.
            assert (await b.request(a2.peer_id, "ping", Ping(n=5), Pong)).n == 6

    run_trio(main)


def test_a_stranger_cannot_open_circuits_into_a_node(run_trio: Callable[..., object]) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            _, (a, mallory) = await open_swarm(stack, RelayLimits(), 2)
            # mallory pretends to be a relay of a's: a accepts circuits only from relays it reserved on.
            await mallory.connect(a.addrs()[0])
            # a refuses before reading a byte (the reset may even overtake the protocol negotiation)
            with contextlib.suppress(PeerUnavailable):
                await mallory.open_raw_stream(a.peer_id, STOP_PROTOCOL)
            await wait_until(lambda: any(r.protocol == STOP for r in a.gate.recent), "a to refuse the STOP stream")
            # Nor can it make a dial addresses of its choosing: hole punching runs over relayed connections only.
            with contextlib.suppress(PeerUnavailable):
                await mallory.open_raw_stream(a.peer_id, DCUTR_PROTOCOL)
            await wait_until(lambda: any(r.protocol == DCUTR for r in a.gate.recent), "a to refuse the DCUtR stream")
            assert a.puncher is not None and a.puncher.attempts == 0
            assert a.path_to(mallory.peer_id) == "direct"  # no relayed connection came of it

    run_trio(main)
