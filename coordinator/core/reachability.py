"""The reachability check: can the internet dial a node? Decided here, dialled by the service.

A node behind a home NAT can dial out but cannot be dialled; peers that try stall until their deadline.
So before it joins, a node sends :class:`~protolearn.protocol.coordination.ReachabilityRequest` with its
listen addresses, and the coordinator dials it *back* from a second, throwaway host on a fresh
connection. Reusing the connection the node opened (as py-libp2p's AutoNAT does) proves nothing: that
connection exists because the node dialled out, so it always "reaches" the node.

Anyone can send the request, so the coordinator must not become a port scanner for hire.
:func:`dial_targets` dials only the IP the request's connection comes from (the requester's own
address, as the coordinator sees it), at the TCP ports the requester names, at most
:data:`MAX_DIAL_PORTS` distinct ones, each address ending in the requester's own peer ID. Noise
authenticates that ID, so an answer from another peer is a failed dial, not "public". Per peer at most
one check runs at a time and over all peers at most :data:`MAX_CHECKS` (:class:`ReachabilityDesk`);
each dial is bounded by :data:`DIAL_TIMEOUT_S`.

:func:`decide` turns the dial results into the verdict: ``public`` if any dial reached the node (those
addresses are ``reachable``), ``private`` if every dial failed, ``unknown`` if there was nothing to dial
(no observed TCP address, no port) or no checker host. The verdict, not the node's own claim, is what
the registry stores at join (the last :data:`MAX_VERDICTS` peers are remembered). :func:`offered_relays`
picks the relays a reply offers: the coordinator itself when it relays, then a few live members that
offered to relay and whose verdict is public; :func:`build_reply` bounds the whole answer to the wire's
limits. The coordinator's own relay serves only nodes its check found private (:func:`relay_refusal`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from protolearn.protocol import coordination as cm

# Distinct TCP ports one check dials, each dial's deadline, and checks running at once over all peers.
MAX_DIAL_PORTS = 4
DIAL_TIMEOUT_S = 3.0
MAX_CHECKS = 8
# How long a request waits for one of the MAX_CHECKS slots before it is answered "unknown" (busy), and how
# many may wait at once (past that, busy at once): checks of Sybils pointed at a port that drops SYNs must
# not hold the stream slots that joiners and status readers share.
SLOT_WAIT_S = 10.0
MAX_CHECK_WAITERS = 32
# Verdicts remembered, oldest dropped: enough for every member of a large swarm plus joiners.
MAX_VERDICTS = 4096
# Members offered as relays besides the coordinator itself.
MAX_MEMBER_RELAYS = cm.MAX_RELAYS - 1


@dataclass(frozen=True)
class Verdict:
    verdict: cm.Reachability
    reason: str
    reachable: tuple[str, ...] = ()


# The answer when no check slot freed up in time: says nothing of the node, so it is not recorded.
BUSY = Verdict("unknown", "the coordinator is busy with other reachability checks; retry later")


def _tcp_port(addr: str) -> int | None:
    """The TCP port of a direct ``/ip4|ip6|dns*/<host>/tcp/<port>/...`` address, else None.

    A circuit address names the *relay's* port, so it has none of the node's own."""
    if "/p2p-circuit" in addr:
        return None
    parts = addr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[3] != "tcp" or not parts[4].isdigit():
        return None
    port = int(parts[4])
    return port if 0 < port < 65536 else None


def _host_of(addr: str) -> str:
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 else ""


def dial_targets(observed: tuple[str, int] | None, addrs: Iterable[str], peer_id: str) -> list[str]:
    """The addresses to dial back: ``observed``'s IP (never another) at the distinct TCP ports named in
    ``addrs`` (those whose IP is the observed one first), at most :data:`MAX_DIAL_PORTS`, each ending
    in ``/p2p/<peer_id>``. Empty when the request did not come over TCP (``observed`` None)."""
    if observed is None or not observed[0]:
        return []
    ip = observed[0]
    named = [(a, p) for a in addrs if (p := _tcp_port(a)) is not None]
    ports: list[int] = []
    for _, port in sorted(named, key=lambda ap: _host_of(ap[0]) != ip):  # stable: the same IP's first
        if port not in ports:
            ports.append(port)
    proto = "ip6" if ":" in ip else "ip4"
    return [f"/{proto}/{ip}/tcp/{port}/p2p/{peer_id}" for port in ports[:MAX_DIAL_PORTS]]


def decide(targets: Sequence[str], reached: Iterable[str], *, checker_up: bool = True) -> Verdict:
    """The verdict from the dial-back: ``reached`` are the targets that answered as the requester."""
    if not checker_up:
        return Verdict("unknown", "the coordinator has no host to dial back from")
    if not targets:
        return Verdict("unknown", "nothing to dial back: no TCP connection from this node, or no TCP port in its addresses")
    ports = ", ".join(_port_text(t) for t in targets)
    hits = set(reached)
    ok = tuple(t for t in targets if t in hits)
    if ok:
        return Verdict("public", f"the coordinator dialled back TCP port {', '.join(_port_text(t) for t in ok)} (tried {ports})", ok)
    return Verdict("private", f"the coordinator could not dial back TCP port {ports}")


def _port_text(target: str) -> str:
    return str(_tcp_port(target) or "?")


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost", "0.0.0.0")


def usable_from(addrs: Iterable[str], observed_ip: str) -> list[str]:
    """``addrs`` a requester at ``observed_ip`` can dial: a loopback address only for a requester on
    this machine (a coordinator listening on 0.0.0.0 lists 127.0.0.1 first, useless to anyone else)."""
    if _loopback(observed_ip):
        return list(addrs)
    return [a for a in addrs if not _loopback(_host_of(a))]


def offered_relays(own: Sequence[str], members: Iterable[str]) -> list[str]:
    """The relays to offer: ``own`` (the coordinator's addresses, when it relays) first, then members'
    addresses (public relay-offering members, one address each), at most MAX_RELAYS in all."""
    out: list[str] = []
    for a in own:
        if a not in out and len(out) < cm.MAX_RELAYS:
            out.append(a)
    budget = MAX_MEMBER_RELAYS
    for a in members:
        if budget <= 0 or len(out) >= cm.MAX_RELAYS:
            break
        if a not in out:
            out.append(a)
            budget -= 1
    return out


def build_reply(
    verdict: Verdict, observed: tuple[str, int] | None, own_relays: Sequence[str],
    member_relays: Callable[[int, Callable[[Iterable[str]], list[str]]], list[str]],
) -> cm.ReachabilityReply:
    """The answer to a check: the verdict, what the coordinator saw (``observed``: the requester's IP and
    port), and relays to try: ``own_relays`` (the coordinator's addresses when it relays) first, then
    ``member_relays(limit, usable)``, the first usable address of up to ``limit`` relaying members."""
    ip, port = observed if observed is not None else ("", 0)
    usable = partial(usable_from, observed_ip=ip)
    relays = offered_relays(usable(own_relays), member_relays(MAX_MEMBER_RELAYS, usable))
    return cm.ReachabilityReply(
        verdict=verdict.verdict, reason=verdict.reason[: cm.MAX_TEXT], observed_ip=ip[:64], observed_port=port,
        reachable=[a for a in verdict.reachable if len(a) <= cm.MAX_ADDR][: cm.MAX_ADDRS],
        relays=[a for a in relays if len(a) <= cm.MAX_ADDR][: cm.MAX_RELAYS],
    )


def relay_refusal(*, banned: bool, checked: cm.Reachability, persisted: str | None) -> str | None:
    """Why a peer may not reserve a slot on the coordinator's relay, or None: the relay is for nodes
    behind NATs, which the reachability check found private (``checked``: the verdict in memory; or,
    after a restart, ``persisted`` with its member entry), not for any identity that asks."""
    if banned:
        return "banned"
    if checked == "private" or persisted == "private":
        return None
    return "this relay serves nodes that the coordinator's reachability check found behind a NAT"


class ReachabilityDesk:
    """Which checks are running (one per peer) and the last verdict of each peer (bounded)."""

    def __init__(self, *, max_verdicts: int = MAX_VERDICTS) -> None:
        self.max_verdicts = max_verdicts
        self._running: set[str] = set()
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()

    def begin(self, peer: str) -> bool:
        """Start ``peer``'s check; False while one of its checks is already running."""
        if peer in self._running:
            return False
        self._running.add(peer)
        return True

    def end(self, peer: str) -> None:
        self._running.discard(peer)

    def running(self, peer: str) -> bool:
        return peer in self._running

    def record(self, peer: str, verdict: Verdict) -> None:
        self._verdicts.pop(peer, None)
        self._verdicts[peer] = verdict
        while len(self._verdicts) > self.max_verdicts:
            self._verdicts.popitem(last=False)

    def verdict_of(self, peer: str) -> cm.Reachability:
        """The coordinator's own last verdict on ``peer`` ("unknown" with none)."""
        v = self._verdicts.get(peer)
        return "unknown" if v is None else v.verdict

    def __len__(self) -> int:
        return len(self._verdicts)
