"""Ban evasion: new identities from the address of a recent ban wait (sans-IO).

A banned peer could rejoin at once with a fresh key from the same address and be placed in a stage (issue
27). An identity costs nothing; an address does. So the coordinator notes the IP address each member's
connection comes from (the address it sees, never one a node names), and for ``ban_cooldown_s`` after a
ban it refuses *new* identities from the banned member's address (``cooldown``). Identities it already
knows (a member that restarts with its key) are not new and are not held back.

What it costs an honest household behind the same NAT as a banned peer: their *new* nodes wait out the
cool-down (default 10 minutes); nodes that already joined keep their places, and restarts are unaffected.
Loopback addresses are exempt: every node on the coordinator's own machine is its operator's (and every
test swarm runs there). Past one cool-down a banned operator may come back with new keys, to be judged
like any newcomer (probation, spot checks, the lease discipline).

The address table holds one entry per member that joined (bounded by the registry's members) and one
per address banned within the cool-down; nothing here is persisted, so a coordinator restart forgets
the cool-downs it was serving.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class _Ban(Protocol):
    peer_id: str
    at: float


def _exempt(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return True  # not an IP address (no TCP connection to read one from): nothing to key a cool-down on


@dataclass
class BanCooldown:
    """Which addresses are cooling down after a ban, and whether a joiner from one must wait."""

    cooldown_s: float
    # peer → the IP address its connection came from when it joined
    ip_of: dict[str, str] = field(default_factory=dict)
    # IP address → when a member that joined from it was last banned
    banned_at: dict[str, float] = field(default_factory=dict)
    _bans_seen: int = 0

    def joined(self, peer: str, ip: str | None, members: Mapping[str, object]) -> None:
        """``peer`` joined from ``ip``; ``members``: the registry's (entries it no longer has are dropped
        once the table outgrows it, so departed identities do not pile up)."""
        if ip is None:
            return
        self.ip_of[peer] = ip
        if len(self.ip_of) > 2 * len(members) + 1024:
            self.ip_of = {p: a for p, a in self.ip_of.items() if p in members}

    def wait_s(self, peer: str, ip: str | None, bans: Mapping[str, _Ban], now: float, *, known: bool) -> float:
        """How long ``peer``, joining from ``ip``, must still wait (0: it may join). ``bans``: the policy's bans
        in the order they were made (new ones are taken in here, each once); ``known``: the registry knows it."""
        self._take_in(bans)
        if known or ip is None or self.cooldown_s <= 0 or _exempt(ip):
            return 0.0
        at = self.banned_at.get(ip)
        if at is None:
            return 0.0
        left = at + self.cooldown_s - now
        if left <= 0:
            del self.banned_at[ip]
            return 0.0
        return left

    def _take_in(self, bans: Mapping[str, _Ban]) -> None:
        if len(bans) <= self._bans_seen:
            self._bans_seen = len(bans)
            return
        for ban in list(bans.values())[self._bans_seen:]:
            ip = self.ip_of.get(ban.peer_id)
            if ip is not None:
                self.banned_at[ip] = max(ban.at, self.banned_at.get(ip, ban.at))
        self._bans_seen = len(bans)
