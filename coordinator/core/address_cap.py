"""One address cannot crowd a stage: a cap on the share of a stage's replicas from one IP address and one subnet (sans-IO).

Identities are free, so "a majority of a stage" is only worth something if one operator cannot cheaply
put many identities in one stage (issue 27, rule 6). The coordinator knows the address each member's
connection came from (the host's observation, never a node's word: ``cooldown.py`` keys on the same).
A joiner is placed only in a stage where, counting itself, its address holds at most
``max(1, floor(ip_share * n))`` of the stage's ``n`` live replicas, and its subnet (/24 for IPv4, /64
for IPv6) at most ``max(1, floor(subnet_share * n))``. Where no stage admits it, the join is refused
(``address_cap``) with a line that says why and when to retry (once more members have joined).

What this costs an honest household (several GPUs behind one NAT address): with the defaults (a third
per address, half per subnet), a stage of three replicas takes one of its nodes, a stage of six two, so
its nodes spread over the stages; a household that brings more nodes than the swarm's stages can take
waits for strangers to join. Loopback, private and link-local addresses are exempt: a coordinator that
sees them serves its own machine or its own network (every test swarm, a lab cluster), where the
operator owns every node anyway. Reaching past the cap takes many addresses in many subnets, which cost
money, not keys.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass


def subnet_of(ip: str) -> str | None:
    """The /24 (IPv4) or /64 (IPv6) of a public address, or None where the cap does not apply (not an
    address, or loopback, private, link-local: see the module docstring)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if not addr.is_global:
        return None
    bits = 24 if addr.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


@dataclass(frozen=True)
class AddressCap:
    ip_share: float
    subnet_share: float

    def admits(self, ip: str | None, stage_ips: Iterable[str]) -> bool:
        """Whether a joiner from ``ip`` may join a stage whose live replicas came from ``stage_ips``."""
        subnet = subnet_of(ip) if ip is not None else None
        if subnet is None:
            return True
        ips = list(stage_ips)
        n = len(ips) + 1  # with the joiner
        same_ip = 1 + sum(1 for a in ips if a == ip)
        same_subnet = 1 + sum(1 for a in ips if subnet_of(a) == subnet)
        return same_ip <= max(1, math.floor(self.ip_share * n)) and same_subnet <= max(1, math.floor(self.subnet_share * n))

    def stages_admitting(self, ip: str, placed: Iterable[tuple[int, str]], num_stages: int) -> list[bool]:
        """Per stage, whether a joiner from ``ip`` may join it; ``placed``: (stage, address) of the other live members."""
        ips: list[list[str]] = [[] for _ in range(num_stages)]
        for stage, other in placed:
            if other and 0 <= stage < num_stages:
                ips[stage].append(other)
        return [self.admits(ip, stage_ips) for stage_ips in ips]

    def reason(self, ip: str) -> str:
        return (f"every stage already holds its share of replicas from {ip} or its subnet (at most "
                f"{self.ip_share:.0%} per address, {self.subnet_share:.0%} per subnet); retry once more nodes have joined")
