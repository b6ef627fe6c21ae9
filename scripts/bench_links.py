"""Bench suite ``links``: how faithful the emulated home link is, against its own settings and the kernel's shaping.

``python scripts/bench.py links --json [--mib 64] [--rates 20,50,100] [--quick] [--no-kernel]``

Two processes, a sink and a sender, each with its own libp2p host (the sender's link is
``TransportConfig.link``; the sink is unshaped), as a swarm's nodes are:

- ``rate_ratio`` per rate: the sender, shaped ``RATE,40ms``, sends ``--mib`` MiB as 1 MiB tensor frames
  pipelined on one libp2p stream (the bulk lane off); the sink times them from the first message's
  arrival to the last byte's, so the delay cancels out and what is left is the rate. ``rate_ratio`` =
  measured ÷ set (goal 0.9-1.05). ``lane_rate_ratio``: the same over the bulk lane (4 MiB tensors, the
  lane on, ``RATE,0ms``: each lane tensor also pays its own round trips, which a delay would add).
- ``rtt_ratio``: the sender shaped ``50mbit,40ms``, 30 small messages and their echo on one open
  stream; median ÷ (2 × 40 ms) (goal 0.95-1.2). ``rtt_both_ratio``: the same with the sink shaped too,
  ÷ 2 × (40 + 40) ms (the delays add up). ``request_rtt_ratio``: ``host.request`` (a new stream per
  request, as the node's protocols do), ÷ 2 × 40 ms: py-libp2p's protocol negotiation on a new stream
  costs a round trip of its own, so expect about 2.
- ``kernel_ratio`` per rate (root only, iproute2 and iptables; ``kernel_skipped`` says why not): the
  same stream transfer in the namespaces of ``tests/e2e/netns.py``, the sender in home A and the sink
  in "public", once with our link (``RATE,0ms``, no qdisc) and once unshaped through a ``tbf`` qdisc at
  RATE on router A's uplink (this kernel has no ``netem``, so the kernel side has no delay and ours
  none either). ``kernel_ratio`` = our rate ÷ the kernel's (goal 0.9-1.1).

Each comparison is measured side by side in one invocation. ``--quick``: 8 MiB, rates 20 and 100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
SINK_PORT = 4011
RTT_SPEC, RTT_DELAY_S = "50mbit,40ms", 0.040
RTT_COUNT = 30
FRAME_MIB, LANE_FRAME_MIB = 1, 4
START_S = 60.0


def _out(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _config(link: str | None, bulk: bool) -> Any:
    from protolearn.protocol.link import parse_link
    from protolearn.protocol.transport import TransportConfig

    return TransportConfig(request_timeout_s=120, chunk_timeout_s=60, connect_timeout_s=30, bulk=bulk,
                           link=parse_link(link) if link else None)


async def _role(role: str, args: dict[str, Any]) -> None:
    """One process of the benchmark (this file with ``--role``)."""
    import torch
    import trio

    from protolearn.protocol.identity import Identity
    from protolearn.protocol.tensors import to_frame
    from protolearn.protocol.transport import FramedStream, open_host
    from protolearn.protocol.wire import Message

    class Start(Message):
        KIND: ClassVar[str] = "bench_links_start"
        frames: int

    class Done(Message):
        KIND: ClassVar[str] = "bench_links_done"
        seconds: float
        bytes: int

    class Ping(Message):
        KIND: ClassVar[str] = "bench_links_ping"
        n: int = 0

    if role == "sink":
        async def drain(peer: str, s: FramedStream) -> None:
            start = await s.receive(Start, timeout=60)
            t0, n = time.monotonic(), 0
            for _ in range(start.frames):
                n += len((await s.receive_tensor(chunk_timeout=60)).data)
            await s.send(Done(seconds=time.monotonic() - t0, bytes=n))

        async def echo(peer: str, s: FramedStream) -> None:
            while True:
                try:
                    ping = await s.receive(Ping, timeout=60)
                except Exception:  # noqa: BLE001 - the sender closed the stream: done
                    return
                await s.send(ping)

        async def answer(peer: str, ping: Message) -> Message:
            return ping

        listen = args.get("listen", "/ip4/127.0.0.1/tcp/0")
        async with open_host(Identity.generate(), [listen], _config(args.get("link"), True)) as h:
            h.serve_stream("drain", drain)
            h.serve_stream("echo", echo)
            h.serve("ask", answer, request_type=Ping)
            addr = h.addrs()[0] if "public_ip" not in args else f"/ip4/{args['public_ip']}/tcp/{SINK_PORT}/p2p/{h.peer_id}"
            _out(addr=addr)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        return

    async with open_host(Identity.generate(), ["/ip4/0.0.0.0/tcp/0" if args.get("netns") else "/ip4/127.0.0.1/tcp/0"],
                         _config(args.get("link"), args["bulk"])) as h:
        peer = await h.connect(args["addr"])
        result: dict[str, Any] = {}
        if args["job"] == "rate":
            frame = to_frame(torch.zeros(args["frame_mib"] * 1024 * 1024 // 4))
            frames = max(1, args["mib"] // args["frame_mib"])
            t = time.monotonic()
            async with h.open_stream(peer, "drain") as s:
                await s.send(Start(frames=frames))
                for _ in range(frames):
                    await s.send_tensor(frame)
                done = await s.receive(Done, timeout=600)
            result = {"mbit_s": done.bytes * 8 / done.seconds / 1e6, "seconds": done.seconds, "sender_s": time.monotonic() - t, "bytes": done.bytes,
                      "lane_sent": h.bulk.stats.num_sent if h.bulk is not None else 0}
        else:
            rtts, requests = [], []
            async with h.open_stream(peer, "echo") as s:
                await s.send(Ping())
                await s.receive(Ping)
                for i in range(RTT_COUNT):
                    t = time.monotonic()
                    await s.send(Ping(n=i))
                    await s.receive(Ping)
                    rtts.append(time.monotonic() - t)
            for i in range(RTT_COUNT // 2):
                t = time.monotonic()
                await h.request(peer, "ask", Ping(n=i), Ping)
                requests.append(time.monotonic() - t)
            result = {"rtt_s": statistics.median(rtts), "request_rtt_s": statistics.median(requests)}
        if h.link is not None:
            result["link"] = h.link.snapshot()
        _out(**result)


class _Procs:
    """Sink and sender processes of this file; the sink lives until :meth:`close`."""

    def __init__(self, argv_prefix: list[str] | None = None) -> None:
        self.prefix = argv_prefix or []
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, role: str, args: dict[str, Any], *, keep: bool = False) -> dict[str, Any]:
        argv = [*self.prefix, sys.executable, str(Path(__file__).resolve()), "--role", role, json.dumps(args)]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            err = p.stderr.read() if p.stderr is not None else ""
            raise RuntimeError(f"bench links {role} exited before it reported: {err.strip().splitlines()[-1:] or '(no output)'}")
        if not keep:
            p.communicate(timeout=60)
        return json.loads(line)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.communicate(input="", timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()


def _rates_and_rtt(rates: list[int], mib: int) -> dict[str, Any]:
    procs = _Procs()
    try:
        sink = procs.start("sink", {}, keep=True)["addr"]
        shaped_sink = procs.start("sink", {"link": RTT_SPEC}, keep=True)["addr"]
        out: dict[str, Any] = {"rate_mbit_s": {}, "rate_ratio": {}, "lane_mbit_s": {}, "lane_rate_ratio": {}}
        for rate in rates:
            r = procs.start("send", {"job": "rate", "addr": sink, "link": f"{rate}mbit,40ms", "bulk": False, "mib": mib, "frame_mib": FRAME_MIB})
            out["rate_mbit_s"][f"{rate}mbit"] = round(r["mbit_s"], 3)
            out["rate_ratio"][f"{rate}mbit"] = round(r["mbit_s"] / rate, 4)
            lane = procs.start("send", {"job": "rate", "addr": sink, "link": f"{rate}mbit,0ms", "bulk": True, "mib": mib, "frame_mib": LANE_FRAME_MIB})
            if not lane["lane_sent"]:
                raise RuntimeError("the lane measurement sent nothing over the bulk lane")
            out["lane_mbit_s"][f"{rate}mbit"] = round(lane["mbit_s"], 3)
            out["lane_rate_ratio"][f"{rate}mbit"] = round(lane["mbit_s"] / rate, 4)
        rtt = procs.start("send", {"job": "rtt", "addr": sink, "link": RTT_SPEC, "bulk": False})
        both = procs.start("send", {"job": "rtt", "addr": shaped_sink, "link": RTT_SPEC, "bulk": False})
    finally:
        procs.close()
    out.update({
        "rtt_spec": RTT_SPEC, "rtt_ms": round(rtt["rtt_s"] * 1e3, 2), "rtt_ratio": round(rtt["rtt_s"] / (2 * RTT_DELAY_S), 4),
        "request_rtt_ms": round(rtt["request_rtt_s"] * 1e3, 2), "request_rtt_ratio": round(rtt["request_rtt_s"] / (2 * RTT_DELAY_S), 4),
        "rtt_both_ms": round(both["rtt_s"] * 1e3, 2), "rtt_both_ratio": round(both["rtt_s"] / (4 * RTT_DELAY_S), 4),
    })
    return out


def _kernel(rates: list[int], mib: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.e2e.netns import _cmd, nat_topology, netns_unavailable

    why = netns_unavailable()
    if why is None and not _has_tbf():
        why = "the kernel has no tbf qdisc"
    if why is not None:
        return {"kernel_skipped": why}
    out: dict[str, Any] = {"kernel_mbit_s": {}, "ours_in_netns_mbit_s": {}, "kernel_ratio": {}}
    with nat_topology() as topo:
        sink, sender = _Procs(["ip", "netns", "exec", topo.public]), _Procs(["ip", "netns", "exec", topo.home_a])
        try:
            addr = sink.start("sink", {"listen": f"/ip4/0.0.0.0/tcp/{SINK_PORT}", "public_ip": topo.public_ip}, keep=True)["addr"]
            for rate in rates:
                job = {"job": "rate", "addr": addr, "bulk": False, "mib": mib, "frame_mib": FRAME_MIB, "netns": True}
                ours = sender.start("send", {**job, "link": f"{rate}mbit,0ms"})
                burst = max(4096, int(rate * 1e6 / 8 * 0.004))  # 4 ms of the rate: enough for the kernel's timer
                _cmd(["ip", "netns", "exec", topo.router_a, "tc", "qdisc", "replace", "dev", "wan", "root", "tbf",
                      "rate", f"{rate}mbit", "burst", str(burst), "latency", "400ms"])
                try:
                    kernel = sender.start("send", {**job, "link": None})
                finally:
                    _cmd(["ip", "netns", "exec", topo.router_a, "tc", "qdisc", "del", "dev", "wan", "root"])
                out["ours_in_netns_mbit_s"][f"{rate}mbit"] = round(ours["mbit_s"], 3)
                out["kernel_mbit_s"][f"{rate}mbit"] = round(kernel["mbit_s"], 3)
                out["kernel_ratio"][f"{rate}mbit"] = round(ours["mbit_s"] / kernel["mbit_s"], 4)
        finally:
            sender.close()
            sink.close()
    out["kernel_qdisc"] = "tbf rate RATE burst max(4 KiB, 4 ms of RATE) latency 400ms on router A's uplink"
    return out


def _has_tbf() -> bool:
    probe = f"plk{os.getpid() % 100000}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "50mbit", "burst", "32kbit",
                            "latency", "400ms"], capture_output=True, timeout=10)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py links", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per rate measurement")
    parser.add_argument("--rates", default="20,50,100", help="rates in Mbit/s, comma-separated")
    parser.add_argument("--quick", action="store_true", help="8 MiB at 20 and 100 Mbit/s")
    parser.add_argument("--no-kernel", action="store_true", help="skip the kernel (tbf) comparison")
    args = parser.parse_args(argv)
    rates = [20, 100] if args.quick else [int(r) for r in args.rates.split(",") if r]
    mib = 8 if args.quick else args.mib
    t0 = time.monotonic()
    out: dict[str, Any] = {"mib": mib, "rates_mbit": rates, **_rates_and_rtt(rates, mib)}
    if args.no_kernel:
        out["kernel_skipped"] = "--no-kernel"
    elif os.geteuid() != 0:
        out["kernel_skipped"] = "not root: the kernel comparison builds network namespaces"
    else:
        out.update(_kernel(rates, mib))
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        import logging

        import trio

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        trio.run(_role, sys.argv[2], json.loads(sys.argv[3]))
    else:
        print(json.dumps(run(sys.argv[1:])))
