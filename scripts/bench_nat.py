"""Paths through real NATs: relayed, hole-punched and direct, side by side in one topology.

``python scripts/bench.py nat --json [--random-fully] [--mib 16]`` (root, iproute2 and iptables: it
builds the namespaces of tests/e2e/netns.py). A relay runs in the "public" namespace; node A in home A
reserves a slot on it; node B in home B dials A's relayed address, sends ``--mib`` MiB of 4 MiB
tensors over the relayed connection, waits for the hole punch it started (at most 12 s) and sends the
same over a new stream, which runs on the punched connection if the punch worked. For scale, B also
sends the same bytes to a plain host in "public" that it dials directly through its NAT (the path a
private node takes to any public peer).

Reported: ``reserve_ms``, ``circuit_dial_ms``, ``relayed_mib_s``, ``punch_s`` (from the circuit's
opening to the direct connection; null when it failed), ``path_after`` (``hole-punched`` or
``relayed``), ``second_mib_s`` (the new stream's speed on that path), ``direct_mib_s`` and the ratios
``punched_vs_relayed`` and ``punched_vs_direct``. With ``--random-fully`` the routers randomise
source ports (symmetric NAT): the punch must fail and the relay carry the traffic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELAY_PORT, A_PORT, B_PORT, SINK_PORT = 4005, 4002, 4003, 4004
FRAME_MIB = 4
PUNCH_WAIT_S = 12.0


def _out(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


async def _role(role: str, args: list[str]) -> None:
    """One process of the benchmark, run inside a namespace (this file with ``--role``)."""
    import torch
    import trio

    from protolearn.protocol.identity import Identity
    from protolearn.protocol.tensors import to_frame
    from protolearn.protocol.transport import FramedStream, RelayLimits, TransportConfig, open_host

    cfg = TransportConfig(request_timeout_s=20, chunk_timeout_s=20, connect_timeout_s=10)

    async def sink(peer: str, s: FramedStream) -> None:
        while True:
            await s.receive_tensor()
            await s.send_tensor(to_frame(torch.zeros(1)))  # one ack per tensor: the sender times whole deliveries

    if role in ("relay", "sink"):
        port = RELAY_PORT if role == "relay" else SINK_PORT
        async with open_host(Identity.generate(), [f"/ip4/0.0.0.0/tcp/{port}"], cfg, relay=RelayLimits() if role == "relay" else None) as h:
            h.serve_stream("sink", sink)
            _out(addr=f"/ip4/{args[0]}/tcp/{port}/p2p/{h.peer_id}")
            await trio.sleep(300)
    elif role == "a":
        async with open_host(Identity.generate(), [f"/ip4/0.0.0.0/tcp/{A_PORT}"], cfg) as a:
            a.public_ip = args[1]
            t = time.perf_counter()
            circuit = await a.reserve(args[0], timeout=10)
            a.serve_stream("sink", sink)
            _out(circuit=circuit, reserve_ms=(time.perf_counter() - t) * 1000)
            await trio.sleep(300)
    else:
        circuit, public_ip, sink_addr, mib = args[0], args[1], args[2], int(args[3])
        async with open_host(Identity.generate(), [f"/ip4/0.0.0.0/tcp/{B_PORT}"], cfg) as b:
            b.public_ip = public_ip
            a = circuit.rsplit("/p2p/", 1)[1]
            b.add_peer_addrs(a, [circuit])
            frame = to_frame(torch.zeros(FRAME_MIB * 1024 * 1024 // 4))

            async def send(peer: str) -> float:
                async with b.open_stream(peer, "sink") as s:
                    t = time.perf_counter()
                    for _ in range(max(1, mib // FRAME_MIB)):
                        await s.send_tensor(frame)
                        await s.receive_tensor()
                    return mib / (time.perf_counter() - t)

            t = time.perf_counter()
            await b.connect(circuit)
            opened = time.perf_counter()
            result: dict[str, Any] = {"circuit_dial_ms": (opened - t) * 1000, "path_first": b.path_to(a)}
            result["relayed_mib_s"] = await send(a)
            with trio.move_on_after(max(0.0, PUNCH_WAIT_S - (time.perf_counter() - opened))):
                while b.path_to(a) != "hole-punched":
                    await trio.sleep(0.02)
            result["path_after"] = b.path_to(a)
            result["punch_s"] = time.perf_counter() - opened if result["path_after"] == "hole-punched" else None
            result["second_mib_s"] = await send(a)
            sink_peer = await b.connect(sink_addr)
            result["direct_path"] = b.path_to(sink_peer)
            result["direct_mib_s"] = await send(sink_peer)
            _out(**result)


def measure(*, random_fully: bool = False, mib: int = 16) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.e2e.netns import nat_topology, netns_unavailable

    from protolearn.errors import ConfigError

    why = netns_unavailable()
    if why is not None:
        raise ConfigError(f"the nat benchmark builds network namespaces: {why}")
    me = [sys.executable, str(Path(__file__).resolve()), "--role"]
    with nat_topology(random_fully=random_fully) as topo:
        procs: list[subprocess.Popen[str]] = []
        try:
            def start(ns: str, *argv: str) -> dict[str, Any]:
                p = topo.popen(ns, [*me, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                procs.append(p)
                line = p.stdout.readline() if p.stdout is not None else ""
                if not line:
                    raise RuntimeError(f"{argv[0]} exited before it reported")
                return json.loads(line)

            relay = start(topo.public, "relay", topo.public_ip)["addr"]
            sink = start(topo.public, "sink", topo.public_ip)["addr"]
            a = start(topo.home_a, "a", relay, topo.router_a_wan_ip)
            b = start(topo.home_b, "b", a["circuit"], topo.router_b_wan_ip, sink, str(mib))
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
    result: dict[str, Any] = {"random_fully": random_fully, "mib": mib, "reserve_ms": round(a["reserve_ms"], 1)}
    result.update({k: round(v, 2) if isinstance(v, float) else v for k, v in b.items()})
    second, relayed, direct = b["second_mib_s"], b["relayed_mib_s"], b["direct_mib_s"]
    result["punched_vs_relayed"] = round(second / relayed, 2) if b["path_after"] == "hole-punched" else None
    result["punched_vs_direct"] = round(second / direct, 2) if b["path_after"] == "hole-punched" else None
    return result


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py nat", description=__doc__.splitlines()[0])
    parser.add_argument("--random-fully", action="store_true", help="port-randomising (symmetric) NATs: the punch must fail")
    parser.add_argument("--mib", type=int, default=16, help="MiB sent over each path (in 4 MiB tensors)")
    args = parser.parse_args(argv)
    return measure(random_fully=args.random_fully, mib=args.mib)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        import logging

        import trio

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        trio.run(_role, sys.argv[2], sys.argv[3:])
    else:
        print(json.dumps(measure()))
