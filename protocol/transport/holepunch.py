"""DCUtR hole punching: turn a relayed connection into a direct one, one side at a time and bounded.

Two nodes behind NATs first meet through a relay (:mod:`protolearn.protocol.transport.relay`). Over
that connection they swap the addresses they expect to be reachable at and then dial each other at
the same moment; a NAT that keeps source ports and drops unsolicited packets (as home routers do)
lets both SYNs through, and the result is an ordinary direct TCP connection on which new streams
run. py-libp2p's ``DCUtRProtocol`` does the exchange; :class:`HolePuncher` changes four things that
were measured to go wrong across real NATs (see ``LIBP2P-NOTES.md``):

- **Only the side that opened the circuit punches** (:meth:`Host.connect` starts it once, bounded by
  :data:`PUNCH_DEADLINE_S`). py-libp2p's automatic loop runs on both sides at once and the two
  attempts raced in 2 of 8 runs (``Errno 99``, a Noise handshake hanging 10 s).
- **No "unilateral upgrade" first**: it dials the peer's private addresses, which stalls 10 s.
- **The address offered is the coordinator's view** of this node (public IP + listen port, set by
  the node in ``Host.public_ip``) rather than whatever identify observed.
- **Punches are offered only over relayed connections, through the gate**, and the addresses a peer
  asks us to dial are cut to a few public TCP ones: py-libp2p answers any peer's DCUtR stream and dials
  whatever addresses it names, which would make every host a port scanner for hire.
- A node whose NAT rewrites source ports (the coordinator saw another port than the one it dialled
  from) cannot be punched to: such a node sets ``Host.punch = False``, and its circuits stay relayed
  without spending the ~21 s a failed punch costs.

A punch that succeeds is remembered, so ``Host.path_to`` can say "hole-punched" rather than "direct".
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol, _local_tcp_listen_addrs
from multiaddr import Multiaddr

log = logging.getLogger("protolearn.protocol")

# How long the opener of a circuit tries to punch before it settles for the relay.
PUNCH_DEADLINE_S = 8.0
# The deadlines of one DCUtR exchange's reads, writes and dials (py-libp2p defaults: 30, 30, 10 s).
EXCHANGE_TIMEOUT_S = 5
DIAL_TIMEOUT_S = 3
# Addresses of a peer a punch dials at most (the peer names them), and the gate's name for the protocol.
MAX_PUNCH_ADDRS = 4
DCUTR = "dcutr"


class HolePuncher(DCUtRProtocol):
    """py-libp2p's DCUtR with the changes listed in the module docstring."""

    def __init__(self, lp: IHost) -> None:
        super().__init__(lp, read_timeout=EXCHANGE_TIMEOUT_S, write_timeout=EXCHANGE_TIMEOUT_S, dial_timeout=DIAL_TIMEOUT_S)
        self.public_ip: str | None = None
        self.punched: set[str] = set()
        self.attempts = 0
        self.successes = 0

    def install(self, host: Any) -> None:
        """Serve DCUtR through ``host``'s gate (a Host), over relayed connections only. Call it after the
        service started: that replaces the ungated handler py-libp2p registers in ``run``."""

        async def on_stream(peer: str, raw: Any) -> None:
            if host.path_to(peer) != "relayed":
                host.gate.reject(peer, DCUTR, "Refused", "hole punching is offered only over a relayed connection", host.clock())
                await host.close_raw(raw, reset=True)
                return
            await self._handle_dcutr_stream(raw)

        host.serve_raw(DCUTR_PROTOCOL, DCUTR, on_stream, max_inbound=16, max_inbound_per_peer=1)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        """At most MAX_PUNCH_ADDRS of the peer's addresses, TCP to a routable IP only: never link-local,
        multicast or a private (RFC 1918) range of the network we are in, and loopback only for a host
        that itself listens on loopback alone (a swarm on one machine)."""
        listen = [ipaddress.ip_address(ip) for _, ip, _ in _local_tcp_listen_addrs(self.host)]
        one_machine = bool(listen) and all(ip.is_loopback for ip in listen)
        out: list[Multiaddr] = []
        for addr in super()._decode_observed_addrs(addr_bytes[: 4 * MAX_PUNCH_ADDRS]):
            parts = str(addr).split("/")
            if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
                continue
            try:
                ip = ipaddress.ip_address(parts[2])
            except ValueError:
                continue
            if (ip.is_loopback and not one_machine) or ip.is_link_local or ip.is_multicast or ip.is_unspecified or any(ip in net for net in _LOCAL_NETS):
                continue
            out.append(addr)
        return out[:MAX_PUNCH_ADDRS]

    async def _auto_drive_loop(self) -> None:
        return None  # only the circuit's opener punches, and only when asked

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        return False  # a peer reached through a relay advertised no address we could dial

    async def _get_observed_addrs(self) -> list[bytes]:
        if self.public_ip is None:
            return await super()._get_observed_addrs()
        ports = [port for family, _, port in _local_tcp_listen_addrs(self.host) if family == 4]
        return [Multiaddr(f"/ip4/{self.public_ip}/tcp/{port}").to_bytes() for port in dict.fromkeys(ports)]

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False) -> bool:
        self.attempts += 1
        ok = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        if ok:
            self.successes += 1
            self.punched.add(str(peer_id))
        return ok

    async def punch(self, peer: str) -> bool:
        """Try once, within PUNCH_DEADLINE_S, to replace the relayed connection to ``peer`` by a direct one."""
        with trio.move_on_after(PUNCH_DEADLINE_S):
            try:
                ok = await self.initiate_hole_punch(ID.from_base58(peer))
            except Exception as err:  # py-libp2p's DCUtR raises many types; a failed punch is not an error here
                log.info("hole punch failed peer=%s reason=%s: %s", peer, type(err).__name__, err)
                return False
            log.info("hole punch %s peer=%s", "succeeded" if ok else "failed", peer)
            return bool(ok)
        log.info("hole punch gave up after %g s peer=%s; the relay carries the traffic", PUNCH_DEADLINE_S, peer)
        return False

    def on_peer_disconnected(self, peer_id: Any) -> None:
        """py-libp2p calls this when *any* connection to the peer closes, also the relayed one it closes
        itself a while after a successful punch; the punched connection may well live on."""
        super().on_peer_disconnected(peer_id)
        if not any(not c.is_closed for c in self.host.get_network().get_connections(peer_id)):
            self.punched.discard(str(peer_id))


_LOCAL_NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")]


__all__ = ["PUNCH_DEADLINE_S", "HolePuncher"]
