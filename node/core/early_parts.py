"""Collective parts that arrive before their round starts here: held, but within per-peer bounds.

A faster replica can get a step's accounting first and send its parts before this replica starts
the round, so such parts are held until then (:mod:`protolearn.node.averaging`). Anyone can open a
collective stream, though, so holding is where a peer could make this node keep memory it never
uses (issue 12, attack 9: 40 parts from a non-member once held 39 MiB). So, sans-IO:

- a part is admitted **after its header was checked and before its payload is read**
  (:meth:`EarlyParts.reserve` with the header's byte count), so a refused part costs no payload;
- per peer at most ``max_parts_per_peer`` parts and ``peer_bytes`` bytes (2× the stage's vector by
  default: an honest replica sends at most a scatter and a gather part, plus a fin, for each of the
  two rounds that may be held, and each part is at most the vector);
- in all at most ``max_parts`` parts and ``total_bytes`` bytes (4× the vector);
- senders that are not members of this stage in the node's view (when the node gives one) share
  ``outsider_bytes`` (1× the vector) between them, since a member that has just joined may not be
  in the view yet, but non-members must not crowd the members out.

The reservation becomes the held part (:meth:`hold`) or is given back (:meth:`unreserve`); a part
handed to its round (:meth:`take`) or dropped as too old (:meth:`drop_before`) frees its share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_PARTS_PER_PEER = 8
PEER_VECTORS = 2.0  # a peer's held bytes, in vectors
TOTAL_VECTORS = 4.0  # everyone's
OUTSIDER_VECTORS = 1.0  # non-members', together
MAX_PARTS = 2 * 1024


@dataclass
class _Peer:
    num_parts: int = 0
    num_bytes: int = 0


@dataclass
class EarlyParts(Generic[T]):
    """Held parts by round, with the per-peer and total accounting (see the module docstring)."""

    vector_bytes: int
    max_parts_per_peer: int = MAX_PARTS_PER_PEER
    max_parts: int = MAX_PARTS
    peer_bytes: int = 0  # 0: PEER_VECTORS × vector_bytes (and so for the next two)
    total_bytes: int = 0
    outsider_bytes: int = 0
    held_bytes: int = 0  # reserved or held, everyone
    num_parts: int = 0
    outsider_held: int = 0
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _outsiders: set[str] = field(default_factory=set)
    _rounds: dict[int, list[tuple[str, int, T]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        v = max(4, self.vector_bytes)
        self.peer_bytes = self.peer_bytes or int(PEER_VECTORS * v)
        self.total_bytes = self.total_bytes or int(TOTAL_VECTORS * v)
        self.outsider_bytes = self.outsider_bytes or int(OUTSIDER_VECTORS * v)

    def reserve(self, peer: str, num_bytes: int, *, member: bool = True) -> str | None:
        """Count one part of ``num_bytes`` from ``peer`` in, or return why not (nothing is counted then)."""
        p = self._peers.get(peer, _Peer())
        if p.num_parts >= self.max_parts_per_peer:
            return f"peer holds {p.num_parts} early parts here, its limit is {self.max_parts_per_peer}"
        if p.num_bytes + num_bytes > self.peer_bytes:
            return f"peer holds {p.num_bytes} early bytes here, {num_bytes} more exceed its limit of {self.peer_bytes}"
        if self.num_parts >= self.max_parts or self.held_bytes + num_bytes > self.total_bytes:
            return f"{self.num_parts} early parts of {self.held_bytes} bytes held, {num_bytes} more exceed the limit of {self.total_bytes}"
        outsider = not member or peer in self._outsiders
        if outsider and self.outsider_held + num_bytes > self.outsider_bytes:
            return f"not a member of this stage; non-members hold {self.outsider_held} early bytes, the limit is {self.outsider_bytes}"
        p.num_parts += 1
        p.num_bytes += num_bytes
        self._peers[peer] = p
        self.num_parts += 1
        self.held_bytes += num_bytes
        if outsider:
            self._outsiders.add(peer)
            self.outsider_held += num_bytes
        return None

    def unreserve(self, peer: str, num_bytes: int) -> None:
        """Give back what :meth:`reserve` counted (the part was refused, failed or went to its round)."""
        p = self._peers[peer]
        p.num_parts -= 1
        p.num_bytes -= num_bytes
        self.num_parts -= 1
        self.held_bytes -= num_bytes
        if peer in self._outsiders:
            self.outsider_held -= num_bytes
        if p.num_parts == 0:
            del self._peers[peer]
            self._outsiders.discard(peer)

    def hold(self, round_id: int, peer: str, num_bytes: int, item: T) -> None:
        """Keep a reserved part until its round starts."""
        self._rounds.setdefault(round_id, []).append((peer, num_bytes, item))

    def take(self, round_id: int) -> list[T]:
        """The parts held for ``round_id``, which leave the accounting."""
        held = self._rounds.pop(round_id, [])
        for peer, n, _ in held:
            self.unreserve(peer, n)
        return [item for _, _, item in held]

    def drop_before(self, round_id: int) -> None:
        for r in [r for r in self._rounds if r < round_id]:
            self.take(r)

    def peer_held(self, peer: str) -> int:
        """Bytes ``peer`` has reserved or held here."""
        p = self._peers.get(peer)
        return 0 if p is None else p.num_bytes
