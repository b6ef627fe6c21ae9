"""A dead peer is dialled a few times, not ten times a second, before the coordinator's word (issue 28).

Real libp2p hosts on 127.0.0.1. Host A keeps asking for peer B by ID after B's process is gone, as a
neighbour's spot checks, gradients and probes did until the coordinator's view dropped B. A's
transport clock is a fake one, so the back-off passes only when the test advances it; the dials are
counted where they cost: py-libp2p's ``Failed to open TCP stream`` ERROR lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import trio

from protolearn.protocol.dial_book import FIRST_BACKOFF_S, MAX_FAILURES
from protolearn.protocol.errors import PeerUnavailable
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import Host, open_host
from protolearn.protocol.wire import Message

from tests.integration.conftest import FAST_CONFIG

# Callers asking for the dead peer in the window: far more than the dials it may cost.
NUM_ASKS = 40
TCP_LOGGER = "libp2p.transport.tcp.tcp"


class Ping(Message):
    KIND: ClassVar[str] = "test_dial_ping"


class Pong(Message):
    KIND: ClassVar[str] = "test_dial_pong"


async def pong(peer: str, req: Message) -> Message:
    return Pong()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += "Failed to open TCP stream" in record.getMessage()


@contextmanager
def tcp_failures() -> Iterator[_Count]:
    """Counts py-libp2p's refused TCP dials (one ERROR line each) while the block runs."""
    handler, logger = _Count(), logging.getLogger(TCP_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


async def wait_disconnected(a: Host, peer: str, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while a.num_connections(peer):
            await trio.sleep(0.02)


async def ask(a: Host, peer: str, n: int) -> tuple[int, int]:
    """``n`` requests to ``peer`` by ID, one after the other: (how many were answered, how many were
    refused by the dial book without a dial)."""
    answered = held = 0
    for _ in range(n):
        try:
            await a.request(peer, "ping", Ping(), Pong, timeout=5.0)
            answered += 1
        except PeerUnavailable as err:
            held += err.reason.startswith("not dialling it")
    return answered, held


def test_a_dead_peer_is_dialled_at_most_max_failures_times_then_once_per_backoff(run_trio) -> None:
    clock = FakeClock()
    b_id = Identity.from_private_bytes(bytes(range(32)))  # seeded: B restarts with the same identity

    async def main() -> None:
        async with open_host(Identity.from_private_bytes(bytes(range(1, 33))), config=FAST_CONFIG, clock=clock) as a:
            async with open_host(b_id, config=FAST_CONFIG) as b:
                b.serve("ping", pong, request_type=Ping)
                a.add_peer_addrs(b.peer_id, b.addrs())
                assert await ask(a, b.peer_id, 1) == (1, 0)
            await wait_disconnected(a, b_id.peer_id)  # B's process is gone: its port refuses

            with tcp_failures() as failed:
                answered, held = await ask(a, b_id.peer_id, NUM_ASKS)
            assert answered == 0 and held == NUM_ASKS - MAX_FAILURES
            assert a.dial_book.failures(b_id.peer_id) == MAX_FAILURES
            # Each dial is one or more refused TCP attempts (py-libp2p retries inside a dial); before, every
            # one of the NUM_ASKS requests dialled.
            per_dial = failed.n / MAX_FAILURES
            assert 1 <= per_dial <= 4, failed.n

            # The back-off passes: one trial dial, and the asks after it wait again.
            clock.now += FIRST_BACKOFF_S
            with tcp_failures() as failed:
                assert await ask(a, b_id.peer_id, NUM_ASKS) == (0, NUM_ASKS - 1)
            assert failed.n == per_dial

            # B rejoins at a new address, which the coordinator's view tells A: A dials it at once,
            # with no time passed.
            async with open_host(b_id, config=FAST_CONFIG) as b:
                b.serve("ping", pong, request_type=Ping)
                a.add_peer_addrs(b.peer_id, b.addrs())
                assert await ask(a, b.peer_id, 1) == (1, 0)
                assert a.dial_book.failures(b.peer_id) == 0

    run_trio(main)


def test_a_peer_that_left_the_view_or_connected_itself_is_dialled_at_once(run_trio) -> None:
    clock = FakeClock()
    b_id = Identity.from_private_bytes(bytes(range(2, 34)))

    async def main() -> None:
        async with open_host(Identity.from_private_bytes(bytes(range(3, 35))), config=FAST_CONFIG, clock=clock) as a:
            a.serve("ping", pong, request_type=Ping)
            async with open_host(b_id, config=FAST_CONFIG) as b:
                b.serve("ping", pong, request_type=Ping)
                a.add_peer_addrs(b.peer_id, b.addrs())
                addrs = b.addrs()
                port = addrs[0].split("/")[4]
                assert await ask(a, b.peer_id, 1) == (1, 0)
            await wait_disconnected(a, b_id.peer_id)
            assert (await ask(a, b_id.peer_id, NUM_ASKS))[1] == NUM_ASKS - MAX_FAILURES

            # The coordinator's view drops B (its heartbeats expired) and later holds it again, at the
            # same address: its old failures say nothing of the new member.
            a.retain_dial_failures(set())
            a.add_peer_addrs(b_id.peer_id, addrs)
            async with open_host(b_id, [f"/ip4/127.0.0.1/tcp/{port}"], config=FAST_CONFIG) as b:
                b.serve("ping", pong, request_type=Ping)
                assert await ask(a, b.peer_id, 1) == (1, 0)
            await wait_disconnected(a, b_id.peer_id)
            assert (await ask(a, b_id.peer_id, NUM_ASKS))[1] == NUM_ASKS - MAX_FAILURES

            # Without any word from the coordinator: B restarts and dials A itself; that it connected
            # shows it is alive, and A's next request to it goes through at once.
            async with open_host(b_id, [f"/ip4/127.0.0.1/tcp/{port}"], config=FAST_CONFIG) as b:
                b.serve("ping", pong, request_type=Ping)
                b.add_peer_addrs(a.peer_id, a.addrs())
                assert await ask(b, a.peer_id, 1) == (1, 0)
                assert a.dial_book.failures(b.peer_id) == 0
                assert await ask(a, b.peer_id, 1) == (1, 0)

    run_trio(main)
