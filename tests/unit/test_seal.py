"""The bulk lane's sealed chunks on a local socket pair, with the transport's clock injected.

The per-chunk deadline is read from the injected clock (protocol/transport/clock.py), so a peer that
trickles bytes past it is caught here without waiting for the deadline in real time.
"""

from __future__ import annotations

import socket
import threading

import pytest

from protolearn.protocol.errors import PeerTimeout
from protolearn.protocol.transport.seal import CHUNK_BYTES, KEY_BYTES, receive_chunks, seal_chunks, send_chunks

KEY = bytes(range(KEY_BYTES))


class SteppingClock:
    """A fake clock that moves ``step`` seconds forward on every read."""

    def __init__(self, step: float) -> None:
        self.now = 1000.0
        self.step = step
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


def test_a_payload_goes_through_and_the_deadline_is_read_from_the_injected_clock() -> None:
    data = bytes(range(256)) * (3 * CHUNK_BYTES // 256 + 7)  # three full chunks and a short fourth
    out = bytearray(len(data))
    clock = SteppingClock(0.0)  # frozen: no deadline can pass
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=send_chunks, args=(a, KEY, memoryview(data)), kwargs={"peer": "p", "chunk_timeout": 5.0})
        sender.start()
        receive_chunks(b, KEY, out, peer="sender", chunk_timeout=5.0, clock=clock)
        sender.join(10)
    assert out == data
    assert clock.reads >= 2 * 4  # each of the 4 chunks: its deadline, then at least one check of it


def test_a_peer_that_trickles_a_chunk_past_its_deadline_is_timed_out_by_the_clock() -> None:
    out = bytearray(2 * CHUNK_BYTES)
    wire = b"".join(bytes(c) for c in seal_chunks(KEY, memoryview(bytes(len(out)))))
    clock = SteppingClock(6.0)  # each read moves 6 s: the second check of a 10 s deadline is past it
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire[:1000])  # part of chunk 0, and the connection stays open
        with pytest.raises(PeerTimeout, match="chunk 0 of 2 not complete within 10 s") as info:
            receive_chunks(b, KEY, out, peer="slowpoke", chunk_timeout=10.0, clock=clock)
    assert info.value.peer == "slowpoke"
