"""Ban evasion (issue 27): a banned peer rejoined at once with a new key from the same address and was placed
in a stage. New identities from the address of a recent ban now wait; known identities and other addresses
do not. The real coordinator core, a fake clock, addresses as the coordinator's host would see them."""

from __future__ import annotations

import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from tests.support.coordinator import make_core

SETTINGS = CoordinatorSettings(rate_per_s=1e9, rate_burst=1e9, ban_cooldown_s=600.0)
HOME, OTHER = "203.0.113.7", "198.51.100.20"


def join(core, peer: str, ip: str, now: float):
    return core.handle(peer, cm.Join(addrs=["/ip4/10.0.0.1/tcp/1"], throughput=100.0), now, ip=ip)


def test_new_identities_from_a_banned_members_address_wait_out_the_cooldown() -> None:
    core = make_core(settings=SETTINGS)
    for peer, ip in (("liar", HOME), ("housemate", HOME), ("far", OTHER)):
        assert isinstance(join(core, peer, ip, 0.0), cm.JoinReply)
    core.ban("liar", "integrity: test", 10.0)
    with pytest.raises(Refusal) as err:
        join(core, "liar-new-key", HOME, 11.0)
    assert err.value.code == "cooldown" and f"from {HOME}" in err.value.reason and "in 599 s" in err.value.reason
    assert isinstance(join(core, "newcomer", OTHER, 11.0), cm.JoinReply), "another address is not held back"
    # A member that already joined from there (a housemate restarting with its key) keeps its place.
    core.handle("housemate", cm.Leave(), 12.0)
    assert isinstance(join(core, "housemate", HOME, 13.0), cm.JoinReply)
    # The banned key itself stays banned; after the cool-down a new key is judged like any newcomer.
    with pytest.raises(Refusal, match="banned"):
        join(core, "liar", HOME, 700.0)
    assert isinstance(join(core, "liar-new-key", HOME, 611.0), cm.JoinReply)


def test_loopback_and_a_zero_cooldown_hold_nobody_back() -> None:
    for settings, ip in ((SETTINGS, "127.0.0.1"), (SETTINGS.model_copy(update={"ban_cooldown_s": 0.0}), HOME)):
        core = make_core(settings=settings)
        join(core, "liar", ip, 0.0)
        core.ban("liar", "test", 1.0)
        assert isinstance(join(core, "liar-new-key", ip, 2.0), cm.JoinReply)
