"""Chunked tensor streams between real hosts: bit-identical transfer, header checks, dead peers."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import trio

from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError
from protolearn.protocol.transport import FramedStream, TensorHeader
from protolearn.protocol.tensors import from_frame, to_frame
from protolearn.protocol.transport import TransportConfig
from protolearn.protocol.wire import Message

MiB = 1024 * 1024


class Ack(Message):
    KIND: ClassVar[str] = "test_stream_ack"
    num_bytes: int


def test_64_mib_tensor_streams_bit_identical_both_ways(open_hosts, run_trio, fast_config):
    # A (4096, 4096) float32 tensor: 64 MiB, with a pattern that catches reordered or dropped chunks.
    # The bulk lane is off, so the bytes go through the stream (test_transport_bulk.py covers the lane).
    sent = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(3))
    received: list[torch.Tensor] = []

    async def sink(peer: str, s: FramedStream) -> None:
        frame = await s.receive_tensor(dtype=torch.float32, shape=[4096, 4096])
        received.append(from_frame(frame, peer=peer, dtype=torch.float32, shape=[4096, 4096], require_finite=True))
        await s.send(Ack(num_bytes=len(frame.data)))
        await s.send_tensor(frame)  # echo it back: the download direction

    async def main():
        async with open_hosts(2, fast_config.model_copy(update={"bulk": False})) as (server, client):
            server.serve_stream("sink", sink)
            async with client.open_stream(server.peer_id, "sink") as s:
                await s.send_tensor(to_frame(sent))
                assert (await s.receive(Ack)).num_bytes == 64 * MiB
                back = await s.receive_tensor(dtype=torch.float32, shape=[4096, 4096])
            assert torch.equal(from_frame(back, peer=server.peer_id), sent)

    run_trio(main, timeout=60)
    assert len(received) == 1 and torch.equal(received[0], sent)


def test_tensor_header_is_checked_before_the_payload(open_hosts, run_trio):
    outcomes: list[str] = []

    async def sink(peer: str, s: FramedStream) -> None:
        try:
            await s.receive_tensor(dtype=torch.float32, shape=[8, 8])
        except ProtocolError as err:
            outcomes.append(f"{type(err).__name__}: {err.reason}")
            raise

    async def main():
        async with open_hosts(2) as (server, client):
            server.serve_stream("sink", sink)
            bad = [
                TensorHeader(codec="none", dtype="float16", shape=[8, 8], data_bytes=128),
                TensorHeader(codec="none", dtype="float32", shape=[8, 9], data_bytes=288),
                TensorHeader(codec="none", dtype="float32", shape=[8, 8], data_bytes=1 << 40),
                TensorHeader(codec="none", dtype="float32", shape=[8, 8], data_bytes=100),
            ]
            for header in bad:
                async with client.open_stream(server.peer_id, "sink") as s:
                    await s.send(header)
                    with pytest.raises(PeerUnavailable):  # the server resets without reading a payload
                        await s.receive(Ack, timeout=5)
            return server.gate.rejected

    rejected = run_trio(main)
    assert [o.split(":")[0] for o in outcomes] == ["ProtocolError", "ProtocolError", "TooLarge", "ProtocolError"]
    assert "float16" in outcomes[0] and "[8, 9]" in outcomes[1]
    assert rejected["ProtocolError"] == 3 and rejected["TooLarge"] == 1


def test_stream_ended_mid_tensor_is_reported(open_hosts, run_trio):
    errors: list[ProtocolError] = []
    failed = trio.Event()

    async def sink(peer: str, s: FramedStream) -> None:
        try:
            await s.receive_tensor()
        except ProtocolError as err:
            errors.append(err)
            failed.set()
            raise

    async def main():
        async with open_hosts(2) as (server, client):
            server.serve_stream("sink", sink)
            async with client.open_stream(server.peer_id, "sink") as s:
                await s.send(TensorHeader(codec="none", dtype="uint8", shape=[4 * MiB], data_bytes=4 * MiB))
                await s.raw.write(b"x" * MiB)
                # leaving the block half-closes the stream: a clean EOF a quarter of the way in
            with trio.fail_after(15):
                await failed.wait()

    run_trio(main)
    assert isinstance(errors[0], PeerUnavailable)
    assert "stream ended mid-tensor after 1048576 of 4194304 bytes" in errors[0].reason


SENDER = textwrap.dedent(
    """
    import sys, trio, torch
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TensorHeader
    from protolearn.protocol.transport import open_host

    async def main():
        async with open_host(Identity.generate()) as host:
            async with host.open_stream(sys.argv[1], "sink") as s:
                await s.send(TensorHeader(codec="none", dtype="uint8", shape=[64 << 20], data_bytes=64 << 20))
                chunk = b"y" * (1 << 20)
                for k in range(10**6):  # until killed
                    await s.raw.write(chunk)  # waits for the receiver's window: it has read most of it
                    if k == 2:
                        print("streaming", flush=True)  # a few MiB arrived: the receiver is mid-tensor
                    await trio.sleep(0.05)

    trio.run(main)
    """
)


def test_peer_sigkilled_mid_transfer_raises_typed_error(open_hosts, run_trio, tmp_path: Path):
    config = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=3.0, connect_timeout_s=5.0)
    errors: list[tuple[ProtocolError, float]] = []
    failed = trio.Event()

    async def sink(peer: str, s: FramedStream) -> None:
        try:
            await s.receive_tensor()
        except ProtocolError as err:
            errors.append((err, trio.current_time()))
            failed.set()
            raise

    async def main():
        async with open_hosts(1, config) as (server,):
            server.serve_stream("sink", sink)
            script = tmp_path / "sender.py"
            script.write_text(SENDER)
            proc = await trio.lowlevel.open_process([sys.executable, str(script), server.addrs()[0]], stdout=subprocess.PIPE)
            try:
                with trio.fail_after(30):
                    assert await _read_line(proc.stdout) == b"streaming"
                killed_at = trio.current_time()
                proc.send_signal(signal.SIGKILL)
                with trio.fail_after(config.chunk_timeout_s + 10):
                    await failed.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                await proc.stdout.aclose()
            err, at = errors[0]
            assert isinstance(err, (PeerUnavailable, PeerTimeout))
            # At worst the chunk deadline: an EOF is seen at once. The margin is for a loaded machine;
            # what this catches is a receiver that waits past its deadline.
            assert at - killed_at <= config.chunk_timeout_s + 5
            assert server.gate.rejected[type(err).__name__] == 1

    run_trio(main, timeout=60)


async def _read_line(stream: trio.abc.ReceiveStream) -> bytes:
    """One line from a subprocess's stdout, without its newline (the caller sets the deadline)."""
    line = b""
    while not line.endswith(b"\n"):
        piece = await stream.receive_some(1)
        assert piece, f"the process closed its stdout after {line!r}"
        line += piece
    return line[:-1]
