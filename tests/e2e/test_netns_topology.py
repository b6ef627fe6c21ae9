"""The NAT topology of ``tests/e2e/netns.py`` behaves like two homes behind home routers.

Checked with real sockets in the namespaces: an outbound connection from a home reaches public from
its router's WAN address (masquerade); the NAT keeps the client's port unless ``random_fully``; an
unsolicited connection from public, to a home's private address or to its router's WAN address, times
out (dropped) instead of being refused (a RST would break TCP hole punching); and nothing of the
topology outlives its ``with`` block, not even a process left running in it.
"""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.e2e import netns
from tests.e2e.netns import NatTopology, nat_topology, netns_unavailable

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0  # for a script in a namespace to start or finish; they take tens of milliseconds
DROP_PROBE_S = 1.0  # how long an unsolicited connect may wait before it counts as dropped
PORT = 40_000

# Listen on PORT, say "ready", accept N connections (bounded), print each peer (host, port).
SERVER = """
import json, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen(16)
s.settimeout(5.0)
print("ready", flush=True)
for _ in range(n):
    c, peer = s.accept()
    print(json.dumps(peer), flush=True)
    c.close()
"""

# Connect to HOST:PORT once from each local port given (0: any), print the local ports actually used.
CLIENT = """
import json, socket, sys
host, port, local_ports = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
used = []
for lp in local_ports:
    c = socket.socket()
    c.bind(("0.0.0.0", lp))
    c.settimeout(5.0)
    c.connect((host, port))
    used.append(c.getsockname()[1])
    c.close()
print(json.dumps(used))
"""

# One connect attempt to HOST:PORT within TIMEOUT seconds; print how it ended.
PROBE = """
import socket, sys
c = socket.socket()
c.settimeout(float(sys.argv[3]))
try:
    c.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as err:
    print(f"error {err}")
"""


@pytest.fixture(scope="module", autouse=True)
def _need_netns() -> None:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def topo() -> Iterator[NatTopology]:
    with nat_topology(random_fully=False) as t:
        yield t


def namespaces_now() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=WAIT_S, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def start_server(topo: NatTopology, ns: str, num_accepts: int) -> subprocess.Popen[str]:
    """A SERVER in ``ns``, returned once it listens (the "ready" line, waited for with a bound)."""
    proc = topo.popen(ns, [sys.executable, "-c", SERVER, str(PORT), str(num_accepts)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    # Nothing follows "ready" until a client connects, so readline cannot leave data in the buffer
    # that communicate() (which reads the raw fd) would then miss.
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=WAIT_S)
        pytest.fail(f"server in {ns} did not start: {line!r} {err[-2000:]}")
    return proc


def peers_seen(server: subprocess.Popen[str]) -> list[tuple[str, int]]:
    out, err = server.communicate(timeout=WAIT_S)
    assert server.returncode == 0, err[-2000:]
    return [tuple(json.loads(line)) for line in out.splitlines()]


def connect_from(topo: NatTopology, ns: str, host: str, local_ports: list[int]) -> list[int]:
    argv = [sys.executable, "-c", CLIENT, host, str(PORT), *map(str, local_ports)]
    out = topo.run(ns, argv, capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def probe_from(topo: NatTopology, ns: str, host: str, timeout: float = DROP_PROBE_S) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", PROBE, host, str(PORT), str(timeout)]
    return topo.popen(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def probe_result(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-2000:]
    return out.strip()


def test_a_home_reaches_public_from_its_routers_wan_address_with_its_port_kept(topo: NatTopology) -> None:
    for home, wan_ip in ((topo.home_a, topo.router_a_wan_ip), (topo.home_b, topo.router_b_wan_ip)):
        server = start_server(topo, topo.public, num_accepts=2)
        used = connect_from(topo, home, topo.public_ip, [41_001, 41_002])
        assert used == [41_001, 41_002]
        assert peers_seen(server) == [(wan_ip, 41_001), (wan_ip, 41_002)]


def test_random_fully_masquerades_to_fresh_ports() -> None:
    # Each port is drawn from ~64k: all 5 landing on the client's own port is a ~1e-24 event.
    with nat_topology(random_fully=True) as topo:
        server = start_server(topo, topo.public, num_accepts=5)
        local_ports = [41_001, 41_002, 41_003, 41_004, 41_005]
        assert connect_from(topo, topo.home_a, topo.public_ip, local_ports) == local_ports
        peers = peers_seen(server)
    assert [host for host, _ in peers] == [topo.router_a_wan_ip] * 5
    assert [port for _, port in peers] != local_ports


def test_unsolicited_inbound_is_dropped_not_refused() -> None:
    with nat_topology() as topo:
        # Route the private network at router A, as a neighbour on its WAN link could: then only the
        # router's firewall, not a missing route, stands between public and home A.
        topo.run(topo.public, ["ip", "route", "add", "10.77.1.0/24", "via", topo.router_a_wan_ip],
                 check=True, capture_output=True, timeout=WAIT_S)
        listener = start_server(topo, topo.home_a, num_accepts=1)
        to_home = probe_from(topo, topo.public, topo.home_a_ip)
        to_wan = probe_from(topo, topo.public, topo.router_a_wan_ip)
        assert probe_result(to_home) == "timeout"
        assert probe_result(to_wan) == "timeout"
        # The listener was up all along: the router, from the LAN side, gets through to it.
        assert probe_result(probe_from(topo, topo.router_a, topo.home_a_ip, timeout=WAIT_S)) == "connected"
        assert [host for host, _ in peers_seen(listener)] == ["10.77.1.1"]


def test_nothing_outlives_the_with_block_even_a_failed_body_and_a_running_process() -> None:
    with pytest.raises(RuntimeError, match="body failed"):
        with nat_topology() as topo:
            assert set(topo.namespaces) <= namespaces_now()
            left_running = topo.popen(topo.home_a, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("body failed")
    assert left_running.wait(timeout=WAIT_S) == -signal.SIGKILL
    assert not set(topo.namespaces) & namespaces_now()


def test_a_setup_that_fails_halfway_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = re.compile(r"^pl[0-9a-f]{6}-")
    before = {ns for ns in namespaces_now() if ours.match(ns)}
    # Router B's LAN address is set late in the build, after all five namespaces exist.
    monkeypatch.setattr(netns, "ROUTER_B_LAN_IP", "10.77.2.300")
    with pytest.raises(netns.NetnsError, match="10.77.2.300"):
        with nat_topology():
            pytest.fail("the build should have failed")
    assert {ns for ns in namespaces_now() if ours.match(ns)} == before
