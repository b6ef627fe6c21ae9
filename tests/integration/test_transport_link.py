"""The emulated link in the transport (protocol/transport/link.py), between real hosts on loopback.

Every bound here is a lower bound the link model enforces (a transfer cannot beat its serialisation
time, a round trip cannot beat the delays); how close the link gets to them is the benchmark's
business (``bench.py links``), so nothing here depends on the machine's speed.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import trio
from protolearn.protocol.identity import Identity
from protolearn.protocol.link import DEFAULT_BURST_BYTES, parse_link
from protolearn.protocol.tensors import to_frame
from protolearn.protocol.transport import FramedStream, TransportConfig, open_host
from protolearn.protocol.wire import Message

CONFIG = TransportConfig(request_timeout_s=20.0, chunk_timeout_s=20.0, connect_timeout_s=10.0)


class Hello(Message):
    KIND: ClassVar[str] = "link_test_hello"
    n: int = 0


def _shaped(spec: str) -> TransportConfig:
    return CONFIG.model_copy(update={"link": parse_link(spec)})


def test_a_shaped_sender_takes_at_least_the_serialisation_time(run_trio) -> None:
    """A stream tensor and a bulk-lane tensor from an 8 Mbit/s host: every byte it put on the wire passed
    its link, and the receiver had them no sooner than bytes / rate + delay after the send began."""
    rate, delay = 1e6, 0.03  # 8mbit, in bytes per second
    small, large = to_frame(torch.ones(96 * 1024)), to_frame(torch.ones(384 * 1024))  # 384 KiB in-stream, 1.5 MiB on the lane
    done: list[tuple[float, int]] = []

    async def main() -> None:
        async with open_host(Identity.generate(), config=CONFIG) as b, open_host(Identity.generate(), config=_shaped("8mbit,30ms")) as a:
            assert a.link is not None and b.link is None and a.link.clock is a.clock

            async def sink(peer: str, s: FramedStream) -> None:
                for _ in range(2):
                    await s.receive_tensor()
                done.append((b.clock(), s.bytes_received))
                await s.send(Hello())

            b.serve_stream("sink", sink)
            await a.connect(b.addrs()[0])
            assert a.path_to(b.peer_id) == "direct"  # the host still sees the TCP socket under the shaped connection
            started = a.link.clock()
            async with a.open_stream(b.peer_id, "sink") as s:
                await s.send_tensor(small)
                await s.send_tensor(large)
                await s.receive(Hello)
            payload = len(small.data) + len(large.data)
            (finished, received), = done
            assert received >= payload
            assert finished - started >= payload / rate + delay
            assert a.bulk is not None and a.bulk.stats.num_sent == 1  # the large tensor went over the lane, shaped too
            snap = a.link.snapshot()
            up, wire = snap["up"], snap["wire"]
            assert wire["lane_sent"] >= len(large.data) and wire["conn_sent"] >= len(small.data)
            # All that reached the sockets passed the model (a few bytes may still be on their way).
            assert wire["conn_sent"] + wire["lane_sent"] <= up["bytes"]
            assert up["bytes"] - (wire["conn_sent"] + wire["lane_sent"]) < 64 * 1024
            # ... and on the model's own clock, the bytes took their serialisation time at the rate.
            assert up["last_leave"] - up["first_at"] >= (up["bytes"] - DEFAULT_BURST_BYTES) / rate
            assert up["serialisation_s"] >= payload / rate

    run_trio(main, timeout=120)


def test_a_slow_download_paces_what_the_host_receives(run_trio) -> None:
    rate = 1e6  # down=8mbit
    frame = to_frame(torch.ones(256 * 1024))  # 1 MiB: the bulk lane, received through the down direction
    got: list[float] = []

    async def main() -> None:
        async with open_host(Identity.generate(), config=_shaped("up=50mbit,down=8mbit,10ms")) as a, open_host(Identity.generate(), config=CONFIG) as b:
            async def sink(peer: str, s: FramedStream) -> None:
                await s.receive_tensor()
                got.append(a.clock())

            a.serve_stream("sink", sink)
            await b.connect(a.addrs()[0])
            started = b.clock()
            async with b.open_stream(a.peer_id, "sink") as s:
                await s.send_tensor(frame)
            with trio.fail_after(60):
                while not got:
                    await trio.sleep(0.01)
            assert a.link is not None
            down = a.link.snapshot()["down"]
            assert got[0] - started >= len(frame.data) / rate + 0.01
            assert a.link.stats.lane_received >= len(frame.data)
            assert down["last_leave"] - down["first_at"] >= (down["bytes"] - DEFAULT_BURST_BYTES) / rate

    run_trio(main, timeout=120)


def test_round_trips_cost_the_delays_of_both_ends(run_trio) -> None:
    """On an open stream: 2 x DELAY to an unshaped peer, 2 x (DELAY_a + DELAY_b) between two shaped ones."""
    rtts: dict[str, float] = {}

    async def main() -> None:
        async def echo(peer: str, s: FramedStream) -> None:
            for _ in range(3):
                await s.send(await s.receive(Hello))

        async with (
            open_host(Identity.generate(), config=_shaped("50mbit,30ms")) as a,
            open_host(Identity.generate(), config=CONFIG) as plain,
            open_host(Identity.generate(), config=_shaped("50mbit,20ms")) as shaped,
        ):
            for name, peer in (("plain", plain), ("shaped", shaped)):
                peer.serve_stream("echo", echo)
                await a.connect(peer.addrs()[0])
                async with a.open_stream(peer.peer_id, "echo") as s:
                    await s.send(Hello())
                    await s.receive(Hello)  # the stream is open now
                    t = a.clock()
                    for i in range(2):
                        await s.send(Hello(n=i))
                        await s.receive(Hello)
                    rtts[name] = (a.clock() - t) / 2

    run_trio(main, timeout=120)
    assert rtts["plain"] >= 2 * 0.03
    assert rtts["shaped"] >= 2 * (0.03 + 0.02)
