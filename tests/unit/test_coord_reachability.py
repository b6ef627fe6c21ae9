"""The reachability check's decisions (coordinator/core/reachability.py) and what the core keeps of them."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.core.reachability import (
    MAX_DIAL_PORTS,
    ReachabilityDesk,
    Verdict,
    decide,
    dial_targets,
    offered_relays,
)
from protolearn.coordinator.core.status import SCHEMA_VERSION, STATUS_JSON_SCHEMA
from protolearn.coordinator.store import Store
from protolearn.protocol import coordination as cm
from tests.support.coordinator import default_core as make_core

PEER = "12D3KooWRequester"


# -- dial targets: the coordinator is no port scanner ---------------------------------------------


def test_only_the_observed_ip_is_dialled_at_the_ports_the_requester_names() -> None:
    addrs = ["/ip4/10.9.9.9/tcp/4001/p2p/x", "/ip4/8.8.8.8/tcp/53", "/dns4/victim.example/tcp/22"]
    targets = dial_targets(("203.0.113.7", 51000), addrs, PEER)
    # Other IPs and hostnames are never dialled: only their port numbers count, at the requester's own IP.
    assert targets == [f"/ip4/203.0.113.7/tcp/{p}/p2p/{PEER}" for p in (4001, 53, 22)]
    assert all("/ip4/203.0.113.7/" in t and t.endswith(f"/p2p/{PEER}") for t in targets)


def test_ports_are_distinct_at_most_four_and_the_observed_ips_own_come_first() -> None:
    addrs = [f"/ip4/10.0.0.{k}/tcp/{4000 + k}" for k in range(6)] + ["/ip4/1.2.3.4/tcp/4000", "/ip4/1.2.3.4/tcp/7000"]
    targets = dial_targets(("1.2.3.4", 1), addrs, PEER)
    assert len(targets) == MAX_DIAL_PORTS
    ports = [int(t.split("/")[4]) for t in targets]
    assert ports[:2] == [4000, 7000] and len(set(ports)) == len(ports)


def test_nothing_to_dial_without_a_tcp_connection_or_a_port() -> None:
    assert dial_targets(None, ["/ip4/1.2.3.4/tcp/4001"], PEER) == []
    assert dial_targets(("1.2.3.4", 5), ["/ip4/1.2.3.4/udp/4001", "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/tcp/99999"], PEER) == []
    # A circuit address names the relay's port, not the node's.
    assert dial_targets(("1.2.3.4", 5), [f"/ip4/5.6.7.8/tcp/4001/p2p/relay/p2p-circuit/p2p/{PEER}"], PEER) == []


def test_an_ipv6_observation_dials_ip6() -> None:
    assert dial_targets(("2001:db8::1", 5), ["/ip6/2001:db8::1/tcp/4001"], PEER) == [f"/ip6/2001:db8::1/tcp/4001/p2p/{PEER}"]


# -- the verdict --------------------------------------------------------------------------------


def test_verdict_public_private_unknown() -> None:
    targets = dial_targets(("1.2.3.4", 5), ["/ip4/1.2.3.4/tcp/4001", "/ip4/1.2.3.4/tcp/4002"], PEER)
    v = decide(targets, [targets[1]])
    assert v.verdict == "public" and v.reachable == (targets[1],) and "4002" in v.reason
    v = decide(targets, [])
    assert v.verdict == "private" and v.reachable == () and "4001, 4002" in v.reason
    assert decide([], []).verdict == "unknown"
    assert decide(targets, targets, checker_up=False).verdict == "unknown"
    # An answer for an address that was not a target (another peer, another IP) counts for nothing.
    assert decide(targets, ["/ip4/6.6.6.6/tcp/4001/p2p/x"]).verdict == "private"


# -- relays offered -----------------------------------------------------------------------------


def test_offered_relays_put_the_coordinator_first_and_stop_at_four() -> None:
    assert offered_relays(["/coord"], ["/m1", "/m2", "/m3", "/m4"]) == ["/coord", "/m1", "/m2", "/m3"]
    assert offered_relays([], ["/m1", "/m2", "/m3", "/m4"]) == ["/m1", "/m2", "/m3"]
    assert len(offered_relays(["/c1", "/c2", "/c3", "/c4", "/c5"], ["/m1"])) == cm.MAX_RELAYS


def _check(core, peer: str, verdict: Verdict) -> None:  # type: ignore[no-untyped-def]
    core.begin_reachability(peer, 0.0)
    core.end_reachability(peer, verdict)


PUBLIC = Verdict("public", "dialled back", ("/ip4/1.2.3.4/tcp/1/p2p/x",))
PRIVATE = Verdict("private", "could not dial back TCP port 1")


def test_only_live_public_members_that_offered_to_relay_are_offered() -> None:
    core = make_core()
    for peer, verdict, relay in (("pub-relay", PUBLIC, True), ("priv-relay", PRIVATE, True), ("pub-plain", PUBLIC, False)):
        _check(core, peer, verdict)
        core.handle(peer, cm.Join(addrs=[f"/ip4/1.2.3.4/tcp/1/p2p/{peer}"], relay=relay, reachability="public"), 0.0)
    reply = core.reachability_reply("joiner", PRIVATE, ("5.6.7.8", 9), ["/ip4/9.9.9.9/tcp/7/p2p/coord"])
    assert reply.relays == ["/ip4/9.9.9.9/tcp/7/p2p/coord", "/ip4/1.2.3.4/tcp/1/p2p/pub-relay"]
    assert (reply.observed_ip, reply.observed_port) == ("5.6.7.8", 9)
    # A relay does not get itself offered, and one that leaves is offered no more.
    assert core.reachability_reply("pub-relay", PRIVATE, None, []).relays == []
    core.handle("pub-relay", cm.Leave(), 1.0)
    assert core.reachability_reply("joiner", PRIVATE, None, []).relays == []


def test_at_most_three_members_are_offered_besides_the_coordinator() -> None:
    core = make_core()
    for k in range(6):
        _check(core, f"r{k}", PUBLIC)
        core.handle(f"r{k}", cm.Join(addrs=[f"/ip4/1.2.3.{k}/tcp/1/p2p/r{k}"], relay=True), 0.0)
    relays = core.reachability_reply("joiner", PRIVATE, None, ["/coord/p2p/c"]).relays
    assert relays[0] == "/coord/p2p/c" and len(relays) == cm.MAX_RELAYS


# -- the registry keeps the coordinator's verdict, never the node's claim -----------------------


def test_join_stores_the_coordinators_verdict_not_the_nodes_claim() -> None:
    core = make_core()
    _check(core, "liar", PRIVATE)
    core.handle("liar", cm.Join(addrs=["/ip4/1.2.3.4/tcp/1"], reachability="public", relay=True), 0.0)
    assert core.registry.members["liar"].reachability == "private"
    core.handle("unchecked", cm.Join(addrs=["/ip4/1.2.3.4/tcp/2"], reachability="public"), 0.0)
    assert core.registry.members["unchecked"].reachability == "unknown"
    # A private node that asked to relay is never offered.
    assert core.reachability_reply("x", PRIVATE, None, []).relays == []
    # Checked again later (now public): the live member follows, and its relay offer counts now.
    _check(core, "liar", PUBLIC)
    assert core.registry.members["liar"].reachability == "public"
    assert core.reachability_reply("x", PRIVATE, None, []).relays == ["/ip4/1.2.3.4/tcp/1"]


def test_a_second_check_of_the_same_peer_is_refused_while_one_runs() -> None:
    core = make_core()
    core.begin_reachability("p", 0.0)
    with pytest.raises(Refusal) as err:
        core.begin_reachability("p", 0.0)
    assert err.value.code == "check_running" and "already running" in err.value.reason
    core.begin_reachability("q", 0.0)  # others are not affected
    core.end_reachability("p", None)  # no verdict (e.g. busy): nothing recorded
    assert core.reachability.verdict_of("p") == "unknown"
    core.begin_reachability("p", 0.0)


def test_the_verdicts_kept_are_bounded_oldest_dropped() -> None:
    desk = ReachabilityDesk(max_verdicts=3)
    for k in range(5):
        desk.record(f"p{k}", PUBLIC)
    assert len(desk) == 3 and desk.verdict_of("p0") == "unknown" and desk.verdict_of("p4") == "public"


# -- status schema 3 and persistence ------------------------------------------------------------


def test_status_v3_carries_reachability_and_path_and_validates(tmp_path: Path) -> None:
    core = make_core()
    _check(core, "a", PUBLIC)
    core.handle("a", cm.Join(addrs=["/ip4/127.0.0.1/tcp/9"], throughput=100.0), 0.0)
    core.handle("b", cm.Join(addrs=["/ip4/127.0.0.1/tcp/10"], throughput=100.0), 0.0)
    core.handle("a", cm.Heartbeat(state="training", path="direct"), 0.5)
    core.handle("b", cm.Heartbeat(state="training"), 0.5)
    st = core.handle("x", cm.StatusRequest(), 1.0)
    doc = st.model_dump(mode="json")
    jsonschema.validate(doc, STATUS_JSON_SCHEMA)
    assert doc["schema_version"] == SCHEMA_VERSION >= 3  # the NAT fields came with schema 3
    nodes = {n["peer_id"]: n for n in doc["nodes"]}
    assert (nodes["a"]["reachability"], nodes["a"]["path"]) == ("public", "direct")
    assert (nodes["b"]["reachability"], nodes["b"]["path"]) == ("unknown", "")
    bad = {**doc, "nodes": [{**nodes["a"], "reachability": "maybe"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, STATUS_JSON_SCHEMA)
    # The verdict persists with the member (the store keeps members as JSON rows).
    store = Store(tmp_path)
    store.apply(core.drain(soft=True))
    again = make_core()
    again.restore(**store.load(), now=2.0)
    assert again.registry.members["a"].reachability == "public"


def test_a_store_row_from_before_reachability_loads_as_unknown(tmp_path: Path) -> None:
    core = make_core()
    core.handle("a", cm.Join(addrs=["/ip4/127.0.0.1/tcp/9"]), 0.0)
    store = Store(tmp_path)
    store.apply(core.drain())
    # An older protolearn wrote rows without the new fields.
    import json

    (data,) = store._db.execute("SELECT data FROM members WHERE peer_id = 'a'").fetchone()
    row = {k: v for k, v in json.loads(data).items() if k not in ("reachability", "relay", "path")}
    store._db.execute("UPDATE members SET data = ? WHERE peer_id = 'a'", (json.dumps(row),))
    again = make_core()
    again.restore(**store.load(), now=1.0)
    assert again.registry.members["a"].reachability == "unknown" and not again.registry.members["a"].relay


def test_loopback_relay_addresses_are_offered_only_to_a_requester_on_this_machine() -> None:
    core = make_core()
    own = ["/ip4/127.0.0.1/tcp/7700/p2p/coord", "/ip4/192.0.2.1/tcp/7700/p2p/coord"]
    _check(core, "r", PUBLIC)
    core.handle("r", cm.Join(addrs=["/ip4/127.0.0.1/tcp/1/p2p/r", "/ip4/198.51.100.2/tcp/1/p2p/r"], relay=True), 0.0)
    remote = core.reachability_reply("x", PRIVATE, ("203.0.113.9", 5), own).relays
    assert remote == ["/ip4/192.0.2.1/tcp/7700/p2p/coord", "/ip4/198.51.100.2/tcp/1/p2p/r"]
    local = core.reachability_reply("x", PRIVATE, ("127.0.0.1", 5), own).relays
    assert local == [*own, "/ip4/127.0.0.1/tcp/1/p2p/r"]


def test_a_heartbeat_with_new_addresses_puts_them_in_the_view_at_once() -> None:
    core = make_core()
    old = "/ip4/198.18.0.1/tcp/4001/p2p/12D3KooWRelayOne/p2p-circuit/p2p/n"
    new = "/ip4/198.18.0.1/tcp/4009/p2p/12D3KooWRelayTwo/p2p-circuit/p2p/n"
    core.handle("n", cm.Join(addrs=[old]), 0.0)
    core.handle("n", cm.Heartbeat(state="training"), 1.0)  # no addresses: unchanged
    assert core.registry.members["n"].addrs == [old]
    before = core.registry.view_version
    core.handle("n", cm.Heartbeat(state="training", addrs=[old]), 1.5)  # the same ones: nothing to show
    assert core.registry.view_version == before
    core.handle("n", cm.Heartbeat(state="training", addrs=[new]), 2.0)
    assert core.registry.members["n"].addrs == [new]
    entry = core.registry.view.get("n")
    assert entry is not None and entry.addrs == [new]
    assert core.registry.view_version > before  # its peers learn it with their next heartbeat
