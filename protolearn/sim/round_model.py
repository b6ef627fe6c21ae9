"""The collective round of a large averaging group, timed from its parts' bytes: what the simulator uses in place of
running :class:`~protolearn.protocol.collective.CollectiveRound` message by message.

A round of ``n`` participants averaging a vector of ``V`` bytes moves, per participant, ``V (n-1)/n`` up
in the scatter (a slice to every other part's owner) and the same again in the gather (its reduced part
to every other participant); both phases wait for the slowest uplink. So the data phase lasts

    D = 2 × max_i (V (n-1)/n ÷ up_i) + 4 × the largest one-way delay (slices, parts, fins) + n × MESSAGE_S

where ``MESSAGE_S`` is a part message's own cost (a new libp2p stream, the signature, the checks).
The round starts when the last live participant has joined, so a slow replica that is still finishing
its tickets holds up its stage.

Deaths (what the real round does, :mod:`protolearn.protocol.collective`): a participant that dies before
its slices and its own reduced part were out (the first 3/4 of its data phase) is **left out** (the
survivors commit without it; the node core redoes its tickets); one that dies later is in the result.
Either way the survivors find it out: at once when its process died (a refused dial: one round trip),
after :func:`limit_s` when its host went silent, and its part is taken over by the next owner (half a
data phase more). A participant that left the stage (it resynced or moved) answers probes with "left",
as a dead process does. The round fails outright when no contributor is left, or when it runs past
the node's hard round timeout.

Checked against the real :class:`CollectiveRound` on small groups by ``tests/unit/test_sim_rounds.py``
(:mod:`.real_round` runs it message by message on the same simulated links).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protolearn.protocol.collective.liveness import DEFAULT_FACTOR, DEFAULT_FLOOR_S
from protolearn.sim.costs import Wire

MESSAGE_S = 0.002
CONTRIBUTED_AT = 0.75  # share of the data phase after which a participant's contribution is in


def data_phase_s(vector_bytes: float, wires: list[Wire]) -> float:
    """The scatter and the gather of a round among ``wires``' owners (see the module docstring)."""
    n = len(wires)
    if n <= 1:
        return 0.0
    per_node = vector_bytes * (n - 1) / n
    slowest = max(per_node / w.up_rate for w in wires)
    return 2.0 * slowest + 4.0 * max(w.delay_s for w in wires) + n * MESSAGE_S


def limit_s(vector_bytes: float, n: int, down_bytes_per_s: float) -> float:
    """A wait's limit in the real round (liveness.py): all n-1 incoming parts at the measured rate, times FACTOR."""
    incoming = vector_bytes / max(1, n) * max(1, n - 1)
    return max(DEFAULT_FLOOR_S, DEFAULT_FACTOR * incoming / max(down_bytes_per_s, 1.0))


@dataclass
class Participant:
    wire: Wire
    weight: float
    joined_at: float | None = None
    gone_at: float | None = None  # died or left
    silent: bool = False  # a host that went quiet (found by deadline), not a closed process


@dataclass
class Outcome:
    ended_at: float
    ok: bool
    excluded: list[str]
    reason: str = ""
    causes: tuple[str, ...] = ()


@dataclass
class RoundModel:
    """One round's participants as they join and die; :meth:`projected` says when and how it ends."""

    vector_bytes: float
    timeout_s: float
    members: dict[str, Participant] = field(default_factory=dict)

    def join(self, peer: str, now: float) -> None:
        self.members[peer].joined_at = now

    def gone(self, peer: str, now: float, *, silent: bool) -> None:
        p = self.members.get(peer)
        if p is not None and p.gone_at is None:
            p.gone_at, p.silent = now, silent

    def projected(self) -> Outcome | None:
        """How the round ends, once every live participant joined (None: still waiting for one to join)."""
        live = [q for q, p in self.members.items() if p.gone_at is None]
        if any(self.members[q].joined_at is None for q in live):
            return None
        joined = [p.joined_at for p in self.members.values() if p.joined_at is not None]
        if not joined:
            return None
        first = min(joined)
        wires = [p.wire for p in self.members.values()]
        n = len(wires)
        down = min(w.down_rate for w in wires)
        limit = limit_s(self.vector_bytes, n, down)
        start = max((p.joined_at for p in self.members.values() if p.gone_at is None and p.joined_at is not None), default=first)
        phase = data_phase_s(self.vector_bytes, [self.members[q].wire for q in live] or wires)
        excluded, end = [], start + phase
        for q, p in sorted(self.members.items()):
            if p.gone_at is None:
                continue
            found = max(p.gone_at, first) + (limit if p.silent else 2.0 * p.wire.delay_s + 0.05)
            contributed = p.joined_at is not None and p.gone_at >= p.joined_at + CONTRIBUTED_AT * phase and p.gone_at >= start
            if p.gone_at >= end:
                continue  # it died after the round ended
            if not contributed and p.weight > 0:
                excluded.append(q)
            end = max(end, found + 0.5 * phase)
        contributors = [q for q, p in self.members.items() if p.weight > 0 and q not in excluded]
        if end - first > self.timeout_s:
            missing = sorted(q for q in self.members if q in excluded) or sorted(live)
            return Outcome(first + self.timeout_s, False, excluded, f"timed out after {self.timeout_s:g} s", tuple(missing))
        if not contributors:
            return Outcome(end, False, excluded, "no contribution survived", tuple(excluded))
        return Outcome(end, True, excluded)
