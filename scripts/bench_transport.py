"""Transport throughput: framed 4 MiB tensors versus the same bytes on a bare py-libp2p stream.

``python scripts/bench.py transport --json`` runs this suite. It starts a receiver in a second process
(this file with ``--serve``), connects to it over 127.0.0.1 (TCP + Noise + yamux), and alternates
rounds of two kinds on the same connection:

- ``raw``: the sender writes the bytes in 1 MiB writes on a bare libp2p stream; the receiver reads
  and discards them, then answers one byte. This is the ceiling of py-libp2p on this machine.
- ``frame``: the sender encodes each 4 MiB float32 tensor (``tensors.to_frame``) and streams it with
  ``FramedStream.send_tensor``; the receiver does ``receive_tensor`` with dtype/shape checks and
  ``from_frame`` (the decode), then acknowledges the round.

- ``bulk``: the same framed rounds from a second sender host with the bulk lane on
  (:mod:`protolearn.protocol.transport.bulk`): each 4 MiB payload goes over a direct AES-GCM-sealed TCP
  connection instead of yamux. The ``raw`` and ``frame`` rounds come from a host with the lane off.

Both are timed by the sender from the first byte to the acknowledgement. The medians over rounds give
``frame_mib_s``, ``raw_mib_s``, ``bulk_mib_s`` and ``ratio`` (frame/raw, goal >= 0.8);
``bulk_vs_stream`` is bulk/frame (the lane's speed-up); ``ratio_paired_median`` is the median of
the per-round ratios, which is steadier on a busy machine; ``request_ms_median`` is the round trip of
a 100-byte ``Host.request`` (a new stream each time). The codec encode/decode speeds come from
``scripts/bench_codecs.py`` when it is present.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
import trio

from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import FramedStream
from protolearn.protocol.tensors import from_frame, to_frame
from protolearn.protocol.transport import TransportConfig, open_host
from protolearn.protocol.wire import LENGTH_PREFIX, Message

MiB = 1024 * 1024
FRAME_SHAPE = [1024, 1024]  # float32: 4 MiB per frame
CONFIG = TransportConfig(request_timeout_s=60.0, chunk_timeout_s=30.0, connect_timeout_s=30.0)
STREAM_ONLY = CONFIG.model_copy(update={"bulk": False})


class RoundDone(Message):
    KIND: ClassVar[str] = "bench_round_done"
    num_bytes: int


class EchoRequest(Message):
    KIND: ClassVar[str] = "bench_echo"
    payload: bytes


async def _echo(peer: str, req: Message) -> Message:
    return req


# -- receiver (second process) ------------------------------------------------------------------


async def _raw_sink(peer: str, s: FramedStream) -> None:
    (total,) = LENGTH_PREFIX.unpack(await s.raw.read(LENGTH_PREFIX.size))
    left = total
    while left:
        left -= len(await s.raw.read(min(left, MiB)))
    await s.raw.write(b"k")


async def _frame_sink(peer: str, s: FramedStream) -> None:
    (count,) = LENGTH_PREFIX.unpack(await s.raw.read(LENGTH_PREFIX.size))
    received = 0
    for _ in range(count):
        frame = await s.receive_tensor(codec="none", dtype=torch.float32, shape=FRAME_SHAPE)
        received += from_frame(frame, peer=peer, dtype=torch.float32, shape=FRAME_SHAPE).numel() * 4
    await s.send(RoundDone(num_bytes=received))


async def serve() -> None:
    async with open_host(Identity.generate(), config=CONFIG) as host:
        host.serve_stream("bench_raw", _raw_sink)
        host.serve_stream("bench_frames", _frame_sink)
        host.serve("bench_echo", _echo, request_type=EchoRequest)
        print(host.addrs()[0], flush=True)
        # Runs until the sender closes our stdin.
        await trio.to_thread.run_sync(sys.stdin.read)


# -- sender (this process) ----------------------------------------------------------------------


async def _raw_round(host, peer: str, chunks: list[bytes]) -> float:
    total = sum(len(c) for c in chunks)
    async with host.open_stream(peer, "bench_raw") as s:
        t0 = time.perf_counter()
        await s.raw.write(LENGTH_PREFIX.pack(total))
        for c in chunks:
            await s.raw.write(c)
        assert await s.raw.read(1) == b"k"
        return total / MiB / (time.perf_counter() - t0)


async def _frame_round(host, peer: str, tensors: list[torch.Tensor]) -> float:
    async with host.open_stream(peer, "bench_frames") as s:
        t0 = time.perf_counter()
        await s.raw.write(LENGTH_PREFIX.pack(len(tensors)))
        for t in tensors:
            await s.send_tensor(to_frame(t))  # encode + send
        done = await s.receive(RoundDone)
        elapsed = time.perf_counter() - t0
    return done.num_bytes / MiB / elapsed


async def measure(addr: str, *, frames: int, rounds: int) -> dict:
    tensors = [torch.randn(FRAME_SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(frames)]
    raw_bytes = b"".join(to_frame(t).data for t in tensors)
    chunks = [raw_bytes[i : i + MiB] for i in range(0, len(raw_bytes), MiB)]
    raw: list[float] = []
    framed: list[float] = []
    bulk: list[float] = []
    async with open_host(Identity.generate(), config=STREAM_ONLY) as host, open_host(Identity.generate(), config=CONFIG) as lane_host:
        peer = await host.connect(addr)
        await lane_host.connect(addr)
        await _raw_round(host, peer, chunks[:4])  # warm-up: connection windows, imports, allocator
        await _frame_round(host, peer, tensors[:1])
        await _frame_round(lane_host, peer, tensors[:1])
        for _ in range(rounds):  # alternate so machine noise hits all kinds alike
            raw.append(await _raw_round(host, peer, chunks))
            framed.append(await _frame_round(host, peer, tensors))
            bulk.append(await _frame_round(lane_host, peer, tensors))
        assert lane_host.bulk is not None and lane_host.bulk.stats.num_sent == rounds * len(tensors) + 1, "the lane was not used"
        latencies = []
        request = EchoRequest(payload=b"x" * 100)
        for _ in range(50):  # a new stream per request, as Host.request does
            t0 = time.perf_counter()
            await host.request(peer, "bench_echo", request, EchoRequest)
            latencies.append((time.perf_counter() - t0) * 1000)
    frame_mib_s = statistics.median(framed)
    raw_mib_s = statistics.median(raw)
    return {
        "frame_mib_s": round(frame_mib_s, 1),
        "raw_mib_s": round(raw_mib_s, 1),
        "ratio": round(frame_mib_s / raw_mib_s, 3),
        "bulk_mib_s": round(statistics.median(bulk), 1),
        "bulk_vs_stream": round(statistics.median(b / f for b, f in zip(bulk, framed)), 2),
        "bulk_rounds_mib_s": [round(x, 1) for x in bulk],
        # Each frame round runs right after a raw round, so their ratio cancels most machine noise.
        "ratio_paired_median": round(statistics.median(f / r for f, r in zip(framed, raw)), 3),
        "frame_rounds_mib_s": [round(x, 1) for x in framed],
        "raw_rounds_mib_s": [round(x, 1) for x in raw],
        "request_ms_median": round(statistics.median(latencies), 2),
        "mib_per_round": len(raw_bytes) / MiB,
        "frame_mib": 4,
    }


def _codec_speeds() -> dict | None:
    path = Path(__file__).with_name("bench_codecs.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("protolearn_bench_codecs", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.codec_speeds()


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.py transport")
    parser.add_argument("--frames", type=int, default=16, help="4 MiB frames per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind")
    parser.add_argument("--no-codecs", action="store_true", help="skip the codec speed table")
    args = parser.parse_args(argv)
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert receiver.stdout is not None
        addr = receiver.stdout.readline().strip()
        if not addr.startswith("/"):
            raise SystemExit(f"error: the receiver process did not start (printed {addr!r})")
        result = trio.run(partial(measure, addr, frames=args.frames, rounds=args.rounds))
    finally:
        if receiver.stdin is not None:
            receiver.stdin.close()
        try:
            receiver.wait(timeout=15)
        except subprocess.TimeoutExpired:
            receiver.kill()
            receiver.wait()
        if receiver.stdout is not None:
            receiver.stdout.close()
    if not args.no_codecs:
        speeds = _codec_speeds()
        if speeds is not None:
            result["codecs"] = speeds
    return result


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        trio.run(serve)
    else:
        import json

        print(json.dumps(run(sys.argv[1:]), indent=2))
