"""Heartbeat pacing: the interval the coordinator asks members to beat at, from how many there are (sans-IO).

Every heartbeat costs the coordinator CPU, and the transport, not the core, is most of that cost (measured
in docs/BENCHMARKS.md, "Coordinator over the network": 2.2-2.9 ms per heartbeat as a request on a new
libp2p stream, 95 % of it in py-libp2p; 1.0-1.6 ms on the member's heartbeat stream). At a fixed interval
the load grows with the swarm, and past a few hundred members a small coordinator spends all its time
answering heartbeats. So the interval grows
with the number of live members: ``max(heartbeat_interval_s, num_live / max_heartbeats_per_s)``, rounded
up to a tenth of a second, and the coordinator's heartbeat load stays at most ``max_heartbeats_per_s``
whatever the swarm's size. Replies carry the interval (a join's and every heartbeat's), and a node beats at
the last one it was told. Expiry scales with it: ``expiry_s / heartbeat_interval_s`` intervals (5 by
default) without a heartbeat expire a member, and so do the core's other "silent for two intervals" rules.

**Falling.** The interval rises at once (members told a shorter one beat more often than needed, which
is safe) and falls at most ``fall`` seconds per second, ``fall = (1 - 1/factor) / 2`` with ``factor`` the
expiry in intervals (0.4 at the default 5): a member told interval ``I`` beats again within ``I``; at any
``x <= I`` after it was told, the interval in force is at least ``I - fall x``, so its expiry,
``factor (I - fall x)``, is more than ``x`` whenever ``factor fall < factor - 1``, which this ``fall``
keeps for every factor above 1. A mass departure therefore never expires the members that stay.

**Hostile members.** The interval depends only on the live member count, which only joins move, and a
join costs an identity a connection (per-address caps in protocol/transport/inbound.py, and
``max_stage_share_per_ip`` in address_cap.py). Sybils that join in numbers lengthen everyone's interval:
they slow the detection of a *frozen* member (one whose connection stays open) to ``factor`` intervals;
a member that dies or disconnects is still noticed within ``disconnect_grace_s`` from its connection.
``max_heartbeat_interval_s`` bounds that. A member cannot choose its own interval: beating faster only
spends its own request budget (the per-peer rate limit), beating slower expires it.
"""

from __future__ import annotations

import math

from protolearn.coordinator.config import CoordinatorSettings


class Pacing:
    """The heartbeat interval in force and the expiry that follows from it."""

    def __init__(self, settings: CoordinatorSettings, now: float = 0.0) -> None:
        self.base_s = settings.heartbeat_interval_s
        self.rate = settings.max_heartbeats_per_s
        self.ceiling_s = max(self.base_s, settings.max_heartbeat_interval_s)
        # Expiry in intervals (5 by default): the ratio the settings give at the base interval.
        self.factor = settings.expiry_s / settings.heartbeat_interval_s
        self.fall = (1 - 1 / self.factor) / 2
        self.interval_s = self.base_s
        self._at = now

    def target_s(self, num_live: int) -> float:
        """The interval for ``num_live`` members, before the limit on how fast it falls."""
        if self.rate is None:
            return self.base_s
        wanted = math.ceil(10 * num_live / self.rate) / 10
        return min(self.ceiling_s, max(self.base_s, wanted))

    def update(self, num_live: int, now: float) -> float:
        """The interval in force at ``now`` with ``num_live`` live members (see the module docstring)."""
        target = self.target_s(num_live)
        if target >= self.interval_s:
            self.interval_s = target
        else:
            self.interval_s = max(target, self.interval_s - self.fall * max(0.0, now - self._at))
        self._at = max(self._at, now)
        return self.interval_s

    @property
    def expiry_s(self) -> float:
        """How long a member may stay silent before it expires, at the interval in force."""
        return self.factor * self.interval_s
