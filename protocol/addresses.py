"""Multiaddrs as protolearn prints, parses and listens on them (pure: multiaddr and socket only).

A peer's full address is ``/ip4/<ip>/tcp/<port>/p2p/<peer id>``: users paste it from one machine to
another, so :func:`advertised` turns a wildcard listener (``0.0.0.0``) into addresses that can be
dialled, and :func:`check_port_free` refuses a taken port. py-libp2p listens with SO_REUSEPORT, so a
second host on the same port would otherwise start silently and receive half of the first one's
connections.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

import multiaddr

from protolearn.errors import ConfigError
from protolearn.protocol.errors import PeerUnavailable

LOOPBACK = "127.0.0.1"
# Where a host listens unless told otherwise: loopback, on a port the system picks.
DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"


def parse_multiaddr(text: str, peer: str) -> multiaddr.Multiaddr:
    """Parse ``text``; a bad one raises PeerUnavailable naming ``peer`` (who gave it to us)."""
    try:
        return multiaddr.Multiaddr(text)
    except Exception as err:  # multiaddr raises several unrelated types for bad text
        raise PeerUnavailable(peer, f"invalid multiaddr {text[:200]!r}: {err}") from None


def strip_p2p(addr: multiaddr.Multiaddr) -> multiaddr.Multiaddr:
    """``addr`` without its trailing ``/p2p/<peer id>`` (what a peerstore holds)."""
    pid = addr.get_peer_id()
    return addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{pid}")) if pid else addr


def advertised(listening: Iterable[str], peer_id: str) -> list[str]:
    """Full dialable addresses of a host listening on ``listening``, 127.0.0.1 first.

    A 0.0.0.0 listener becomes 127.0.0.1 plus this machine's primary IPv4 address, so the printed
    address also works from another machine of the same network.
    """
    out: list[str] = []
    for text in listening:
        if "/p2p/" not in text:
            text = f"{text}/p2p/{peer_id}"
        if text.startswith("/ip4/0.0.0.0/"):
            candidates = [text.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in [LOOPBACK, *primary_ipv4()]]
        else:
            candidates = [text]
        out.extend(c for c in candidates if c not in out)
    return sorted(out, key=lambda a: not a.startswith(f"/ip4/{LOOPBACK}/"))


def primary_ipv4() -> list[str]:
    """This machine's IPv4 address on its default route, or nothing without one."""
    # Connecting a UDP socket only picks the outgoing interface; no packet is sent.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            ip = probe.getsockname()[0]
    except OSError:
        return []  # no route at all: loopback is all there is
    return [] if ip.startswith("127.") or ip == "0.0.0.0" else [ip]


class PortInUse(ConfigError):
    """The TCP port to listen on is taken (by another process, or one still shutting down)."""


def check_port_free(addr: multiaddr.Multiaddr) -> None:
    """Raise PortInUse if another socket listens on ``addr``'s TCP port, ConfigError if it is unusable."""
    text = str(addr)
    parts = text.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] == "0":
        return
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # REUSEADDR lets the probe pass over connections of a previous run still in TIME_WAIT.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts[2], int(parts[4])))
        except OSError as err:
            kind = PortInUse if err.errno == errno.EADDRINUSE else ConfigError
            raise kind(f"cannot listen on {text}: {err.strerror}; pick another port or stop the process using it") from None
