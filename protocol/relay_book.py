"""A relay's bookkeeping, sans IO: who holds a reservation and which circuits run, against its limits.

A relay is a service that strangers use, and its limits are the point (see
:mod:`protolearn.protocol.transport.relay` for the protocol and why its handling is our own).
:class:`RelayBook` decides: reservations in total and per IP address (a household shares one,
Sybil identities cost nothing but addresses do), circuits in total, per source and per destination,
and bytes per circuit; slots of lapsed reservations and of holders that disconnected are freed before a
newcomer is refused, so peers that left never keep one out. Every method that can refuse returns the
reason as a string, which the relay sends back and counts against the peer in its gate.

It reads no clock (``now`` is passed in) and does no IO, so it is pure like the gate
(:mod:`protolearn.protocol.gate`), next to the grammar of relayed addresses (:func:`split_circuit`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from protolearn.protocol.errors import PeerUnavailable

CIRCUIT = "/p2p-circuit"


class RelayLimits(BaseModel):
    """What one relay gives away. Frozen; every value must be positive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_reservations: int = Field(default=64, gt=0)
    # Reservations from one IP address: a household shares one, and Sybil identities cost nothing but
    # addresses do, so they cannot take every slot.
    max_reservations_per_ip: int = Field(default=8, gt=0)
    # Circuits one peer may have open at once, as their source and, separately, as their destination.
    max_circuits_per_peer: int = Field(default=8, gt=0)
    max_circuits: int = Field(default=256, gt=0)
    max_circuit_bytes: int = Field(default=1 << 30, gt=0)  # both directions together
    max_circuit_duration_s: float = Field(default=3600.0, gt=0)
    # A reservation lapses unless renewed within this time (a client renews at half of it); one whose
    # holder has disconnected frees its slot at once.
    reservation_ttl_s: float = Field(default=600.0, gt=0)


@dataclass(eq=False)
class Circuit:
    """One relayed connection: ``src`` dialled ``dst`` through this relay."""

    src: str
    dst: str
    opened_at: float
    bytes: int = 0


@dataclass
class RelayBook:
    """Who holds a reservation and which circuits run, against :class:`RelayLimits` (no IO, no clock).

    Every method that can refuse returns the reason as a string, which the relay sends back and
    counts against the peer.
    """

    limits: RelayLimits
    _expiry: dict[str, float] = field(default_factory=dict)
    _ip: dict[str, str] = field(default_factory=dict)  # each holder's IP
    _circuits: set[Circuit] = field(default_factory=set)
    _by_src: Counter[str] = field(default_factory=Counter)
    _by_dst: Counter[str] = field(default_factory=Counter)

    @property
    def num_circuits(self) -> int:
        return len(self._circuits)

    def reserve(self, peer: str, ip: str, now: float, connected: Callable[[str], bool]) -> float | str:
        """Grant or renew the reservation of ``peer`` (connected from ``ip``): its expiry time, or why not.

        Slots of lapsed reservations and of holders no longer connected are freed first, so peers
        that left never keep a newcomer out."""
        if peer not in self._expiry:
            for other in [p for p, t in self._expiry.items() if t <= now or not connected(p)]:
                self.release(other)
            if len(self._expiry) >= self.limits.max_reservations:
                return f"the relay is full ({self.limits.max_reservations} reservations)"
            if sum(1 for p in self._expiry if self._ip.get(p) == ip) >= self.limits.max_reservations_per_ip:
                return f"{ip} already holds {self.limits.max_reservations_per_ip} reservations on this relay"
        self._expiry[peer] = now + self.limits.reservation_ttl_s
        self._ip[peer] = ip
        return self._expiry[peer]

    def holds(self, peer: str, now: float) -> bool:
        return self._expiry.get(peer, 0.0) > now

    def release(self, peer: str) -> None:
        """``peer`` disconnected: its slot is free."""
        self._expiry.pop(peer, None)
        self._ip.pop(peer, None)

    def open(self, src: str, dst: str, now: float) -> Circuit | str:
        """Admit a circuit from ``src`` to ``dst``, or say why not."""
        if not self.holds(dst, now):
            return "the destination holds no reservation on this relay"
        if src == dst:
            return "a peer cannot relay to itself"
        if len(self._circuits) >= self.limits.max_circuits:
            return f"the relay carries its maximum of {self.limits.max_circuits} circuits"
        if self._by_src[src] >= self.limits.max_circuits_per_peer:
            return f"the source already has {self.limits.max_circuits_per_peer} circuits open on this relay"
        if self._by_dst[dst] >= self.limits.max_circuits_per_peer:
            return f"the destination already has {self.limits.max_circuits_per_peer} circuits open on this relay"
        c = Circuit(src, dst, now)
        self._circuits.add(c)
        self._by_src[src] += 1
        self._by_dst[dst] += 1
        return c

    def charge(self, c: Circuit, num_bytes: int) -> str | None:
        """Count ``num_bytes`` more through ``c``; the reason to cut it once it is over its byte limit."""
        c.bytes += num_bytes
        if c.bytes > self.limits.max_circuit_bytes:
            return f"the circuit carried more than its limit of {self.limits.max_circuit_bytes} bytes"
        return None

    def close(self, c: Circuit) -> None:
        if c in self._circuits:
            self._circuits.remove(c)
            self._by_src[c.src] -= 1
            self._by_dst[c.dst] -= 1
            for counts, key in ((self._by_src, c.src), (self._by_dst, c.dst)):
                if counts[key] <= 0:
                    del counts[key]


def is_circuit(addr: str) -> bool:
    return f"{CIRCUIT}/" in addr or addr.endswith(CIRCUIT)


def split_circuit(addr: str, peer: str) -> tuple[str, str]:
    """``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<dest>`` -> (relay's full address, dest peer ID).

    Raises PeerUnavailable (naming ``peer``, who gave us the address) for anything else."""
    relay, sep, rest = addr.partition(CIRCUIT)
    dest = rest.removeprefix("/p2p/")
    if not sep or "/p2p/" not in relay or not rest.startswith("/p2p/") or not dest or "/" in dest:
        raise PeerUnavailable(peer, f"not a relayed address (<relay addr>/p2p/<relay id>/p2p-circuit/p2p/<id>): {addr[:200]!r}")
    return relay, dest


__all__ = ["CIRCUIT", "Circuit", "RelayBook", "RelayLimits", "is_circuit", "split_circuit"]
