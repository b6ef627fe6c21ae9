"""Joining from behind a real NAT (network namespaces, tests/e2e/netns.py): the coordinator's dial-back
finds the node private, the node reserves a slot on the coordinator's relay and joins with its circuit
address; without any relay it stops with the one line that says what to do (issue 14)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from protolearn.protocol.transport import Host
from tests.e2e.test_swarm import TINY

netns = pytest.importorskip("tests.e2e.netns", reason="needs the NAT topology (merging)")

pytestmark = pytest.mark.skipif(not hasattr(Host, "reserve"), reason="needs the relay transport (merging)")

CLI = [sys.executable, "-m", "protolearn.cli.main"]
WAIT_S = 120.0


@pytest.fixture
def topo() -> Iterator[Any]:
    why = netns.netns_unavailable()
    if why:
        pytest.skip(why)
    with netns.nat_topology() as t:
        yield t


def start_coordinator(topo: Any, tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    config = tmp / "run.toml"
    config.write_text(TINY.format(steps=10_000, codec="none", layers=1, stages=1))
    out = (tmp / f"{name}.out").open("w")
    err = (tmp / f"{name}.err").open("w")
    proc = topo.popen(topo.public, [*CLI, "coordinator", "start", "--config", str(config), "--listen", f"/ip4/{topo.public_ip}/tcp/0",
                                    "--data-dir", str(tmp / name), "--log-level", "warning", *extra], stdout=out, stderr=err, text=True)
    out.close()
    err.close()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        text = (tmp / f"{name}.out").read_text()
        if text.endswith("\n"):
            return proc, text.splitlines()[0]
        assert proc.poll() is None, (tmp / f"{name}.err").read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{name} did not print its address")


def node_argv(tmp: Path, name: str, addr: str) -> list[str]:
    return [*CLI, "node", "join", "--coordinator", addr, "--listen", "/ip4/0.0.0.0/tcp/0", "--data-dir", str(tmp / name),
            "--name", name, "--device", "cpu", "--threads", "1", "--coordinator-wait", "0"]


def events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    path = tmp / name / "node.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [d for d in map(json.loads, lines) if d["event"] == event]


def test_a_node_behind_a_nat_joins_through_the_coordinators_relay_or_stops_with_one_line(topo: Any, tmp_path: Path) -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        coord, addr = start_coordinator(topo, tmp_path, "coord", "--relay")
        procs.append(coord)
        err = (tmp_path / "n0.err").open("w")
        node = topo.popen(topo.home_a, node_argv(tmp_path, "n0", addr), stdout=subprocess.DEVNULL, stderr=err, text=True)
        err.close()
        procs.append(node)
        deadline = time.monotonic() + WAIT_S
        while not events(tmp_path, "n0", "reachability"):
            assert node.poll() is None, (tmp_path / "n0.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the node did not finish its reachability check"
            time.sleep(0.2)
        (reach,) = events(tmp_path, "n0", "reachability")
        assert reach["verdict"] == "private" and reach["relay"] == addr
        assert reach["addrs"] == [f"{addr}/p2p-circuit/p2p/{events(tmp_path, 'n0', 'start')[0]['peer_id']}"]
        assert "behind a NAT (private): reachable through relay" in (tmp_path / "n0.err").read_text()
        while True:
            out = topo.run(topo.public, [*CLI, "swarm", "status", "--coordinator", addr, "--json"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr[-2000:]
            nodes = json.loads(out.stdout)["nodes"]
            if nodes and nodes[0]["path"]:
                break
            assert time.monotonic() < deadline, f"the node never reported its path: {nodes}"
            time.sleep(0.5)
        assert (nodes[0]["reachability"], nodes[0]["path"]) == ("private", "relayed")

        # A coordinator that relays for nobody, and no --relay-via: the node cannot be reached at all.
        plain, plain_addr = start_coordinator(topo, tmp_path, "plain")
        procs.append(plain)
        stuck = topo.run(topo.home_b, node_argv(tmp_path, "n1", plain_addr), capture_output=True, text=True, timeout=WAIT_S)
        assert stuck.returncode == 1 and "Traceback" not in stuck.stderr
        last = stuck.stderr.strip().splitlines()[-1]
        assert last.startswith("error: this node cannot be reached from the internet (the coordinator could not dial back TCP port ")
        assert "no relay gave it a slot (none was offered)" in last and "--relay-via MULTIADDR" in last
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
