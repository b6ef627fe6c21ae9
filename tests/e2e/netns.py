"""A real NAT topology from Linux network namespaces, for end-to-end tests of NAT traversal.

The layout, all IPv4::

    home A 10.77.1.2 --lan-- router A --wan 198.18.0.2--+
                                                         +-- br0 in public 198.18.0.1 (coordinator, relay)
    home B 10.77.2.2 --lan-- router B --wan 198.18.0.3--+

The "internet" is one L2 segment: a bridge inside the public namespace with one veth per router. Its
addresses come from 198.18.0.0/15, the benchmark range (RFC 2544), so they can never be confused with a
real host. Each home has a default route via its router; public and the routers share the segment and
need no routes beyond it. Nothing routes the 10.77.x.0/24 networks to public: as on the internet, a
dial from public to a private address fails.

Each router behaves like a home router. It masquerades whatever leaves its WAN side (with
``random_fully=True``, ``--random-fully``: a fresh random source port per connection, a symmetric NAT;
otherwise Linux keeps the client's source port when it is free, a port-preserving NAT). It forwards
from LAN to WAN, and from WAN to LAN only what conntrack matches to a connection that went out. And it
DROPs, rather than answers, new TCP and UDP that arrive at its own WAN address: a plain Linux box would
send a RST (TCP) or an ICMP port-unreachable (UDP) for a closed port, and TCP hole punching depends on
the peer's early SYN vanishing instead of killing the attempt. IPv6 is not configured: routers do not
forward it (forwarding is off in a new namespace), so it offers no path around the NAT.

Every veth is created with both ends already inside namespaces (``ip -n NS link add ... peer ... netns
NS2``), so no interface ever appears in the host's namespace and the short fixed names (``wan``,
``lan``, ``eth0``) cannot clash with anything. Namespace names carry a random suffix
(``pl<6 hex>-<role>``, at most 15 characters), so concurrent runs, or a namespace left by a run that
was killed, never collide with this one. Deleting a namespace deletes the interfaces in it, so cleanup
is: kill what still runs in each namespace, then delete the namespaces that were made. It runs even
when setup fails halfway.

Needs root, ``ip`` (iproute2) and ``iptables`` with conntrack and MASQUERADE support in the kernel;
``netns_unavailable()`` says why not when they are missing, for ``pytest.skip``.

:func:`lan` builds a smaller topology: two namespaces on one veth (198.18.7.1 and .2), no router and no
default route, for tests of the addresses a user pastes from one machine to another.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CMD_TIMEOUT_S = 10.0  # one ip/iptables call; they take milliseconds, so this only catches a hang
KILL_WAIT_S = 5.0  # for SIGKILLed processes to leave a namespace

PUBLIC_IP = "198.18.0.1"
ROUTER_A_WAN_IP = "198.18.0.2"
ROUTER_B_WAN_IP = "198.18.0.3"
ROUTER_A_LAN_IP = "10.77.1.1"
ROUTER_B_LAN_IP = "10.77.2.1"
HOME_A_IP = "10.77.1.2"
HOME_B_IP = "10.77.2.2"
PREFIX_LEN = 24


class NetnsError(RuntimeError):
    """A command that builds or removes the topology failed; the message has its stderr."""


def _cmd(argv: Sequence[str], *, input: str | None = None) -> str:
    try:
        out = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise NetnsError(f"{' '.join(argv)}: no answer in {CMD_TIMEOUT_S} s") from err
    if out.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def router_rules(*, random_fully: bool) -> str:
    """The router's ruleset, in ``iptables-restore`` form (one atomic load instead of a call per rule)."""
    masquerade = "-A POSTROUTING -o wan -j MASQUERADE" + (" --random-fully" if random_fully else "")
    return "\n".join([
        "*nat",
        ":PREROUTING ACCEPT [0:0]",
        ":INPUT ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        ":POSTROUTING ACCEPT [0:0]",
        masquerade,
        "COMMIT",
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        # Silence, not RST or port-unreachable, for anything unsolicited at the WAN address.
        "-A INPUT -i wan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        "-A INPUT -i wan -p tcp -j DROP",
        "-A INPUT -i wan -p udp -j DROP",
        "-A FORWARD -i lan -o wan -j ACCEPT",
        "-A FORWARD -i wan -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        "COMMIT",
        "",
    ])


def _new_prefix() -> str:
    return "pl" + secrets.token_hex(3)


def netns_unavailable() -> str | None:
    """Why the topology cannot be built here, or None when it can.

    It tries the real thing in a throwaway namespace (a bridge, a veth and the router's ruleset),
    because a container may allow ``ip netns add`` and still lack the bridge, veth or NAT modules.
    """
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not on PATH (scripts/setup.sh installs iptables when run as root)"
    probe = _new_prefix() + "-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
    except NetnsError as err:
        return f"cannot create a network namespace: {err}"
    reason = None
    try:
        _cmd(["ip", "-n", probe, "link", "add", "name", "br0", "type", "bridge"])
        _cmd(["ip", "-n", probe, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"])
        _cmd(["ip", "netns", "exec", probe, "iptables-restore"], input=router_rules(random_fully=True))
    except NetnsError as err:
        reason = f"a namespace works but the NAT topology does not: {err}"
    try:
        _cmd(["ip", "netns", "del", probe])
    except NetnsError as err:
        reason = reason or f"cannot delete the probe namespace {probe}: {err}"
    return reason


def namespace_pids(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns``."""
    return [int(pid) for pid in _cmd(["ip", "netns", "pids", ns]).split()]


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process in ``ns`` and wait (bounded) until none is left.

    A test process still running would keep the namespace, and its interfaces, alive after
    ``ip netns del``. Zombies do not count: an exited process has already left its namespaces.
    """
    deadline = time.monotonic() + KILL_WAIT_S
    while pids := namespace_pids(ns):
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in {ns} survive SIGKILL after {KILL_WAIT_S} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited between the listing and the kill, which is what we want
        time.sleep(0.02)


class _InNamespaces:
    """Running commands inside a topology's namespaces."""

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``ns``. The caller bounds every wait on it; the topology's cleanup kills it.

        ``ip netns exec`` execs the command, so the Popen's pid is the command's own.
        """
        return subprocess.Popen(self.argv(ns, argv), **kw)

    def run(
        self, ns: str, argv: Sequence[str], *, timeout: float = 30.0, **kw: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in ``ns`` to completion, within ``timeout`` seconds."""
        return subprocess.run(self.argv(ns, argv), timeout=timeout, **kw)


@dataclass(frozen=True)
class NatTopology(_InNamespaces):
    """Names and addresses of a built topology, and ways to run commands in its namespaces."""

    public: str
    router_a: str
    router_b: str
    home_a: str
    home_b: str
    random_fully: bool
    public_ip: str = PUBLIC_IP
    router_a_wan_ip: str = ROUTER_A_WAN_IP
    router_b_wan_ip: str = ROUTER_B_WAN_IP
    home_a_ip: str = HOME_A_IP
    home_b_ip: str = HOME_B_IP

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.public, self.router_a, self.router_b, self.home_a, self.home_b)


def _build(topo: NatTopology, made: list[str]) -> None:
    for ns in topo.namespaces:
        _cmd(["ip", "netns", "add", ns])
        made.append(ns)
        _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])

    pub = topo.public
    _cmd(["ip", "-n", pub, "link", "add", "name", "br0", "type", "bridge"])
    _cmd(["ip", "-n", pub, "addr", "add", f"{topo.public_ip}/{PREFIX_LEN}", "dev", "br0"])
    _cmd(["ip", "-n", pub, "link", "set", "br0", "up"])

    sides = [
        ("a", topo.router_a, topo.router_a_wan_ip, ROUTER_A_LAN_IP, topo.home_a, topo.home_a_ip),
        ("b", topo.router_b, topo.router_b_wan_ip, ROUTER_B_LAN_IP, topo.home_b, topo.home_b_ip),
    ]
    for side, router, wan_ip, lan_ip, home, home_ip in sides:
        port = f"to-r{side}"  # the router's port on the bridge
        _cmd(["ip", "-n", pub, "link", "add", "name", port, "type", "veth", "peer", "name", "wan", "netns", router])
        _cmd(["ip", "-n", pub, "link", "set", port, "master", "br0", "up"])
        _cmd(["ip", "-n", router, "addr", "add", f"{wan_ip}/{PREFIX_LEN}", "dev", "wan"])
        _cmd(["ip", "-n", router, "link", "set", "wan", "up"])

        _cmd(["ip", "-n", router, "link", "add", "name", "lan", "type", "veth", "peer", "name", "eth0", "netns", home])
        _cmd(["ip", "-n", router, "addr", "add", f"{lan_ip}/{PREFIX_LEN}", "dev", "lan"])
        _cmd(["ip", "-n", router, "link", "set", "lan", "up"])
        _cmd(["ip", "-n", home, "addr", "add", f"{home_ip}/{PREFIX_LEN}", "dev", "eth0"])
        _cmd(["ip", "-n", home, "link", "set", "eth0", "up"])
        _cmd(["ip", "-n", home, "route", "add", "default", "via", lan_ip])

        _cmd(["ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        _cmd(["ip", "netns", "exec", router, "iptables-restore"], input=router_rules(random_fully=topo.random_fully))


def _teardown(made: list[str]) -> None:
    """Kill and delete every namespace in ``made``, trying all of them before reporting a failure."""
    failures = []
    for ns in reversed(made):
        try:
            kill_namespace_processes(ns)
        except NetnsError as err:
            failures.append(str(err))  # still delete it: the namespace goes once those processes die
        try:
            _cmd(["ip", "netns", "del", ns])
        except NetnsError as err:
            failures.append(str(err))
    if failures:
        raise NetnsError("cleanup incomplete: " + "; ".join(failures))


@contextmanager
def nat_topology(*, random_fully: bool = False) -> Iterator[NatTopology]:
    """Build the topology, yield it, and always remove it (processes, namespaces, interfaces)."""
    prefix = _new_prefix()
    topo = NatTopology(
        public=f"{prefix}-pub",
        router_a=f"{prefix}-ra",
        router_b=f"{prefix}-rb",
        home_a=f"{prefix}-ha",
        home_b=f"{prefix}-hb",
        random_fully=random_fully,
    )
    made: list[str] = []
    try:
        _build(topo, made)
        yield topo
    finally:
        _teardown(made)


# Two machines on one network, with no router and no default route (like a LAN without internet): the
# only way one reaches the other is the address on its interface.
LAN_A_IP = "198.18.7.1"
LAN_B_IP = "198.18.7.2"


@dataclass(frozen=True)
class Lan(_InNamespaces):
    """Two namespaces joined by one veth pair, ``eth0`` in each."""

    a: str
    b: str
    a_ip: str = LAN_A_IP
    b_ip: str = LAN_B_IP


def lan_unavailable() -> str | None:
    """Why :func:`lan` cannot be built here (None when it can): it needs root and ``ip``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "'ip' (iproute2) is not on PATH"
    probe = _new_prefix() + "-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
        _cmd(["ip", "netns", "del", probe])
    except NetnsError as err:
        return f"cannot create a network namespace: {err}"
    return None


@contextmanager
def lan() -> Iterator[Lan]:
    """Build the two-machine LAN, yield it, and always remove it (processes, namespaces, interfaces)."""
    prefix = _new_prefix()
    net = Lan(a=f"{prefix}-a", b=f"{prefix}-b")
    made: list[str] = []
    try:
        for ns in (net.a, net.b):
            _cmd(["ip", "netns", "add", ns])
            made.append(ns)
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        _cmd(["ip", "-n", net.a, "link", "add", "name", "eth0", "type", "veth", "peer", "name", "eth0", "netns", net.b])
        for ns, ip in ((net.a, net.a_ip), (net.b, net.b_ip)):
            _cmd(["ip", "-n", ns, "addr", "add", f"{ip}/{PREFIX_LEN}", "dev", "eth0"])
            _cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
        yield net
    finally:
        _teardown(made)
