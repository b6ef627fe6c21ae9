"""The addresses other machines can dial this host at, and which is which, for a user to paste.

A host listening on the wildcard (``/ip4/0.0.0.0/tcp/P``) is reachable at every IPv4 address of this
machine's interfaces. :func:`interface_ipv4` lists them from the interfaces themselves (``getifaddrs``
through the ``ifaddr`` package: nothing is sent), not from the hostname, which resolves to 127.0.1.1 on
stock Debian and Ubuntu. The address of the default route comes first: on a machine with one network
that is the one other machines use.

:func:`dialable` turns a host's listen addresses into :class:`Dialable` entries, best first: the
addresses a user announced (``--announce``, for a host behind port forwarding or a NAT: the public
address, which no interface holds), then a public IP the host was told it is seen at (the coordinator's
reachability check), then the interfaces' addresses (private ranges say "local network"), and loopback
last ("this machine only"). The first entry is the line to paste on other machines. Pure: no trio, no
libp2p.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import multiaddr

from protolearn.errors import ConfigError

LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"


@dataclass(frozen=True)
class Dialable:
    """One full address (``/ip4/…/tcp/…/p2p/<id>``) and what it is, in words a user reads."""

    addr: str
    note: str


def default_route_ipv4() -> str | None:
    """This machine's IPv4 address on its default route (None without one). Connecting a UDP socket only
    picks the outgoing interface; no packet is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any address, never answered
            ip = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == WILDCARD else ip


def interface_ipv4() -> list[tuple[str, str]]:
    """(IPv4 address, interface name) of every non-loopback interface, the default route's first."""
    import ifaddr  # imported here: only a wildcard listener needs it

    found: list[tuple[str, str]] = []
    try:
        adapters = ifaddr.get_adapters()
    except OSError:
        adapters = []
    for adapter in adapters:
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127.") and (ip.ip, adapter.nice_name) not in found:
                found.append((ip.ip, str(adapter.nice_name)))
    first = default_route_ipv4()
    if first is not None and all(ip != first for ip, _ in found):
        found.append((first, "default route"))
    return sorted(found, key=lambda e: e[0] != first)


def _note(ip: str, interface: str) -> str:
    kind = "local network" if ipaddress.ip_address(ip).is_private else "public"
    return f"interface {interface}, {kind}"


def parse_announce(text: str, peer_id: str) -> str:
    """``--announce`` as a full address with ``/p2p/<peer_id>``; one line naming the problem if it is not one."""
    try:
        addr = multiaddr.Multiaddr(text)
    except Exception:  # multiaddr raises several unrelated types for bad text
        raise ConfigError(f"--announce {text!r} is not a multiaddr; give the address others dial, e.g. /ip4/203.0.113.5/tcp/7700") from None
    parts = str(addr).split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        raise ConfigError(f"--announce {text!r} must be /ip4/<address>/tcp/<port> (or /dns4/<name>/tcp/<port>)")
    pid = addr.get_peer_id()
    if pid and pid != peer_id:
        raise ConfigError(f"--announce {text!r} names peer {pid}, but this host is {peer_id}; leave the /p2p/ part out")
    return str(addr) if pid else f"{addr}/p2p/{peer_id}"


def dialable(
    listening: Iterable[str], peer_id: str, *, announce: Sequence[str] = (), public_ip: str | None = None,
    interfaces: Sequence[tuple[str, str]] | None = None,
) -> list[Dialable]:
    """Where other machines (and this one) can dial a host listening on ``listening``, best first (see
    the module docstring). ``interfaces`` defaults to :func:`interface_ipv4` (a test passes its own)."""
    ranked: list[tuple[int, Dialable]] = [(0, Dialable(parse_announce(a, peer_id), "announced")) for a in announce]
    for text in listening:
        full = text if "/p2p/" in text else f"{text}/p2p/{peer_id}"
        ip = full.split("/")[2] if full.startswith("/ip4/") else ""
        if ip != WILDCARD:
            ranked.append((3, Dialable(full, "this machine only")) if ip.startswith("127.") else (2, Dialable(full, "listen address")))
            continue
        tail = full.split("/", 3)[3]  # tcp/<port>/p2p/<id>
        if public_ip:
            ranked.append((1, Dialable(f"/ip4/{public_ip}/{tail}", "public, as the coordinator sees this host")))
        for iface_ip, name in interface_ipv4() if interfaces is None else interfaces:
            ranked.append((2, Dialable(f"/ip4/{iface_ip}/{tail}", _note(iface_ip, name))))
        ranked.append((3, Dialable(f"/ip4/{LOOPBACK}/{tail}", "this machine only")))
    out: list[Dialable] = []
    for _, d in sorted(ranked, key=lambda e: e[0]):  # stable: the order within a rank stays
        if all(o.addr != d.addr for o in out):
            out.append(d)
    return out
