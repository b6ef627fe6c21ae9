"""Is this node reachable from the internet? Ask the coordinator, then advertise what peers can dial.

Before it joins, a node sends its listen addresses in a
:class:`~protolearn.protocol.coordination.ReachabilityRequest`; the coordinator dials it back on a fresh
connection (see ``coordinator/core/reachability.py``) and answers with a verdict:

- ``public``: the addresses the dial-back reached are advertised first, then the node's own. With
  ``--relay`` the node also offers to relay for private nodes.
- ``private`` (behind a NAT): the node's own addresses would make every peer's dial stall until its
  deadline, so it reserves a slot on a relay instead (``--relay-via`` first, then the ones the
  coordinator offers, in order) and advertises only the circuit address the relay gave it. Its stage
  peers then reach it through the relay, or directly once hole punching (DCUtR) upgraded their link.
  With no slot anywhere the node cannot train, so it stops with one line that says what to do.
- ``unknown`` (an older coordinator, an error, nothing to dial): carry on as before, with one warning.

The coordinator also says which (ip, port) it saw the node's connection come from; a port other than
the node's own local port on that connection means its NAT rewrites ports, which hole punching cannot
get through. That is kept on :class:`Reachability` for the transport and the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from protolearn.node.config import NodeConfig
from protolearn.node.errors import JoinError
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.interfaces import WILDCARD, dialable, parse_announce

log = logging.getLogger("protolearn.node")

# The coordinator dials back within a few seconds (and may wait for a free check slot first).
REACHABILITY_TIMEOUT_S = 15.0
# One relay reservation's deadline.
RESERVE_TIMEOUT_S = 5.0
# A private node checks this often whether it is still connected to its relay, and looks for another
# after this many failed checks in a row (the transport retries the relay itself every 2 s meanwhile).
RELAY_CHECK_S = 3.0
RELAY_LOST_CHECKS = 3


@dataclass(frozen=True)
class Reachability:
    """What this node learnt about itself, and what it advertises because of it."""

    verdict: cm.Reachability
    reason: str
    # The addresses the node joins with (what its peers dial).
    addrs: list[str]
    # The relay it holds a slot on (private nodes), "" for none.
    relay: str = ""
    # What the coordinator saw: the (ip, port) the node's connection came from (0: unknown) ...
    observed_ip: str = ""
    observed_port: int = 0
    # ... and the node's own port on that connection (None: unknown).
    local_port: int | None = None
    failures: list[str] = field(default_factory=list)
    # The relays the coordinator offered at this check (a private node moves to one if its relay goes).
    offered: tuple[str, ...] = ()

    @property
    def rewrites_ports(self) -> bool | None:
        """Whether a NAT between the node and the coordinator changes its source port (None: unknown)."""
        if not self.observed_port or self.local_port is None:
            return None
        return self.observed_port != self.local_port


def joinable(addrs: Iterable[str]) -> list[str]:
    """``addrs`` without duplicates and too-long entries, at most what a Join carries."""
    out: list[str] = []
    for a in addrs:
        if len(a) <= cm.MAX_ADDR and a not in out:
            out.append(a)
    return out[: cm.MAX_ADDRS]


def dialable_addrs(host: Any, listen: str) -> list[str]:
    """The host's own addresses as other machines should try them: for a wildcard listener, every
    interface's address (the default route's first), loopback last; otherwise what it listens on."""
    own = list(host.addrs())
    if not listen.startswith(f"/ip4/{WILDCARD}/") or not own:
        return own
    port = own[0].split("/")[4]
    return [d.addr for d in dialable([f"/ip4/{WILDCARD}/tcp/{port}"], host.peer_id)]


def relay_candidates(relay_via: Sequence[str], offered: Sequence[str]) -> list[str]:
    """The relays to try, in order: the user's ``--relay-via`` first, then the coordinator's offers."""
    return list(dict.fromkeys([*relay_via, *offered]))


def relay_peer(addr: str) -> str:
    """The peer ID a relay's full address ends in."""
    return addr.rpartition("/p2p/")[2]


def short_peer(addr: str) -> str:
    """The last 8 characters of the peer ID an address ends in (the address itself without one)."""
    _, sep, peer = addr.rpartition("/p2p/")
    return peer[-8:] if sep and peer else addr


def tcp_ports(addrs: Iterable[str]) -> list[int]:
    """The distinct TCP ports of direct addresses (what the coordinator dials back)."""
    out: list[int] = []
    for a in addrs:
        parts = a.split("/")
        if "/p2p-circuit" in a or len(parts) < 5 or parts[3] != "tcp" or not parts[4].isdigit():
            continue
        if int(parts[4]) not in out:
            out.append(int(parts[4]))
    return out


def unreachable_error(ports: Sequence[int], failures: Sequence[str]) -> JoinError:
    """The one line a private node with no relay slot stops with."""
    port = ", ".join(map(str, ports)) or "?"
    tried = "; ".join(failures) if failures else "none was offered"
    return JoinError(
        f"this node cannot be reached from the internet (the coordinator could not dial back TCP port {port}) and no relay "
        f"gave it a slot ({tried}): open or forward TCP port {port} to this machine, or pass --relay-via MULTIADDR of a relay "
        "(a coordinator started with --relay, or a public node joined with --relay)"
    )


def heartbeat_path(verdict: str, host: Any, peers: Iterable[str]) -> str:
    """How this node's stage peers reach it now: ``direct`` when it is public; when it is private, the
    best path it has to any of ``peers`` (those it exchanges tensors with): ``hole-punched`` once a link
    was upgraded by hole punching, ``direct`` to a public peer it dialled, else ``relayed``; "" when
    nobody knows (an ``unknown`` verdict)."""
    if verdict == "public":
        return "direct"
    if verdict != "private":
        return ""
    paths = {host.path_to(p) for p in peers}
    # The best path any of them has: a private node dials public peers directly, and a punch upgrades.
    return next((p for p in ("hole-punched", "direct") if p in paths), "relayed")


async def move_relay(host: Any, config: NodeConfig, reach: Reachability, *, say: Callable[[str], None]) -> Reachability | None:
    """Reserve on another relay this node knows (``--relay-via``, then those offered at its last check),
    not ``reach.relay``: ``reach`` with the new relay and circuit address, or None when none had a slot.
    No new check is needed for that: the node is as private as it was."""
    for relay in [r for r in relay_candidates(config.relay_via, reach.offered) if r != reach.relay]:
        try:
            circuit = await host.reserve(relay, timeout=RESERVE_TIMEOUT_S)
        except ProtocolError as err:
            log.info("relay reservation failed relay=%s reason=%s", relay, err.reason)
            continue
        say(f"this node is behind a NAT (private): reachable through relay {short_peer(relay)}")
        return replace(reach, addrs=joinable([circuit]), relay=relay)
    return None


async def ask_reachability(host: Any, coordinator: str, addrs: list[str], *, timeout: float) -> cm.ReachabilityReply:
    """Ask the coordinator (peer ID ``coordinator``, already connected) to dial this node back.

    Any failure, including a coordinator too old to know the request, is an ``unknown`` verdict."""
    try:
        return await host.request(
            coordinator, cm.COORDINATOR, cm.ReachabilityRequest(addrs=joinable(addrs)), cm.ReachabilityReply, timeout=timeout,
        )
    except ProtocolError as err:
        return cm.ReachabilityReply(verdict="unknown", reason=f"the reachability check failed: {err.reason}"[: cm.MAX_TEXT])


async def establish(
    host: Any, coordinator: str, config: NodeConfig, *, say: Callable[[str], None] | None = None, avoid: str = "",
) -> Reachability:
    """Check this node's reachability and decide what it advertises (see the module docstring);
    a private node without a relay slot raises one JoinError line."""
    say = say or log.warning
    # Announced addresses first (port forwarding: no interface holds them), then the interfaces' own.
    own = [parse_announce(a, host.peer_id) for a in config.announce] + dialable_addrs(host, config.listen)
    timeout = min(REACHABILITY_TIMEOUT_S, config.request_timeout_s)
    reply = await ask_reachability(host, coordinator, own, timeout=timeout)
    seen = {"observed_ip": reply.observed_ip, "observed_port": reply.observed_port, "local_port": host.local_port(coordinator)}
    if reply.verdict == "public":
        found = Reachability("public", reply.reason, joinable([*reply.reachable, *own]), **seen)
        if found.addrs:
            say(f"reachable from other machines at {found.addrs[0]} (the coordinator dialled it back)")
        return found
    if reply.verdict == "unknown":
        log.warning("could not tell whether this node is reachable from the internet (%s); advertising its own addresses", reply.reason)
        return Reachability("unknown", reply.reason, joinable(own), **seen)
    failures: list[str] = []
    for relay in [r for r in relay_candidates(config.relay_via, reply.relays) if r != avoid]:
        try:
            circuit = await host.reserve(relay, timeout=RESERVE_TIMEOUT_S)
        except ProtocolError as err:
            failures.append(f"{short_peer(relay)}: {err.reason}")
            log.info("relay reservation failed relay=%s reason=%s", relay, err.reason)
            continue
        say(f"this node is behind a NAT (private): reachable through relay {short_peer(relay)}")
        found = Reachability("private", reply.reason, joinable([circuit]), relay=relay, failures=failures, offered=tuple(reply.relays), **seen)
        # Hole punching offers the address the coordinator saw (public IP) at the listen port, which a
        # NAT that rewrites source ports does not keep: such a node leaves its circuits relayed.
        host.public_ip = reply.observed_ip or None
        host.punch = found.rewrites_ports is not True
        if not host.punch:
            log.info("this node's NAT rewrites source ports (%s seen as %d): no hole punching, peers stay relayed", found.local_port, found.observed_port)
        return found
    raise unreachable_error(tcp_ports(own), failures)
