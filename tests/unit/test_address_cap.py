"""One address cannot crowd a stage (issue 27, rule 6): the per-address and per-subnet share of a stage's replicas."""

from __future__ import annotations

import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.address_cap import AddressCap, subnet_of
from protolearn.coordinator.core.assignment import shares_from_layers
from protolearn.coordinator.core.members import JoinInfo
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from tests.support.coordinator import make_core, run_info

SETTINGS = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=3.0, move_cooldown_s=0.0)


def registry(num_stages: int = 3) -> Registry:
    return Registry(num_stages, shares_from_layers([1] * num_stages), SETTINGS)


def info(ip: str | None) -> JoinInfo:
    return JoinInfo(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0, ip=ip)


def test_the_cap_keys_on_public_addresses_and_their_subnets_only() -> None:
    assert subnet_of("81.2.69.10") == "81.2.69.0/24"
    assert subnet_of("2a00:1450:4001:81a::200e") == "2a00:1450:4001:81a::/64"
    for exempt in ("127.0.0.1", "::1", "10.1.2.3", "192.168.1.5", "169.254.0.1", "not an address"):
        assert subnet_of(exempt) is None, exempt
    cap = AddressCap(1 / 3, 0.5)
    assert cap.admits("81.2.69.10", [])  # the first replica of a stage, whoever sends it
    assert not cap.admits("81.2.69.10", ["81.2.69.10"])  # two of two
    assert not cap.admits("81.2.69.10", ["81.2.69.10", "5.6.7.8"])  # two of three: over a third
    assert cap.admits("81.2.69.10", ["81.2.69.10", "5.6.7.8", "9.9.9.9", "1.1.1.1", "8.8.4.4"])  # two of six
    assert not cap.admits("81.2.69.11", ["81.2.69.10", "5.6.7.8"])  # another address of the same /24: two of three
    assert cap.admits("127.0.0.1", ["127.0.0.1"] * 10)


def test_identities_from_one_address_spread_over_the_stages_and_then_wait() -> None:
    """The review's steering, by many keys from one address: each stage takes one of them beside one honest
    replica, and the next is refused with a reason, instead of landing wherever the attacker wants."""
    r = registry(3)
    for k, ip in enumerate(("5.6.7.8", "9.9.9.9", "1.1.1.1")):
        assert r.join(f"h{k}", info(ip), 0.0).stage == k
    stages = []
    for k in range(3):
        d = r.join(f"sybil{k}", info("81.2.69.10"), 1.0)
        assert d.accepted, d.reason
        stages.append(d.stage)
    assert sorted(stages) == [0, 1, 2]
    d = r.join("sybil3", info("81.2.69.10"), 1.0)
    assert not d.accepted and d.code == "address_cap"
    assert "81.2.69.10" in d.reason and "retry" in d.reason
    d = r.join("sybil4", info("81.2.69.77"), 1.0)  # another address of the same /24
    assert not d.accepted and d.code == "address_cap"
    assert r.join("stranger", info("45.33.32.156"), 1.0).accepted  # everyone else still joins


def test_a_node_of_the_operator_s_own_machine_or_network_is_never_capped() -> None:
    r = registry(2)
    for k in range(8):
        assert r.join(f"lo{k}", info("127.0.0.1"), 0.0).accepted
        assert r.join(f"lan{k}", info("192.168.1.5"), 0.0).accepted
        assert r.join(f"unknown{k}", info(None), 0.0).accepted


def test_a_returning_identity_is_not_capped_by_its_own_old_entry() -> None:
    r = registry(2)
    assert r.join("h", info("5.6.7.8"), 0.0).stage == 0
    assert r.join("a", info("81.2.69.10"), 0.0).stage == 1
    r.leave("a", 1.0)
    d = r.join("a", info("81.2.69.10"), 2.0)
    assert d.accepted and d.rejoined


def test_the_coordinator_refuses_an_over_cap_join_with_the_address_it_saw() -> None:
    core = make_core(run_info(2))
    join = cm.Join(addrs=["/ip4/81.2.69.10/tcp/1"], throughput=100.0)
    assert core.handle("h", cm.Join(addrs=["/ip4/5.6.7.8/tcp/1"], throughput=100.0), 0.0, ip="5.6.7.8").stage == 0
    assert core.handle("a", join, 0.0, ip="81.2.69.10").stage == 1
    assert core.handle("b", join, 0.0, ip="81.2.69.10").stage == 0  # stage 0 has one replica from elsewhere
    with pytest.raises(Refusal) as err:
        core.handle("c", join, 0.0, ip="81.2.69.10")
    assert err.value.code == "address_cap"
    assert core.registry.members["a"].ip == "81.2.69.10"
