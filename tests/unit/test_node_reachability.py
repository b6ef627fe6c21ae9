"""A node's side of the reachability check (node/reachability.py): what it advertises for each verdict,
the one line a private node without a relay stops with, the heartbeat's path, and --relay-via checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from protolearn.node.config import NodeConfig
from protolearn.node.errors import JoinError
from protolearn.node.reachability import Reachability, establish, heartbeat_path
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import PeerUnavailable, Refused
from protolearn.protocol.identity import Identity
from pydantic import ValidationError

COORD = f"/ip4/127.0.0.1/tcp/7700/p2p/{Identity.generate().peer_id}"
SELF = Identity.generate().peer_id
OWN = [f"/ip4/192.168.1.5/tcp/4001/p2p/{SELF}"]
RELAY_A_ID, RELAY_B_ID = Identity.generate().peer_id, Identity.generate().peer_id
RELAY_A = f"/ip4/5.5.5.5/tcp/4001/p2p/{RELAY_A_ID}"
RELAY_B = f"/ip4/6.6.6.6/tcp/4001/p2p/{RELAY_B_ID}"


class FakeHost:
    """The transport calls establish() makes: a canned reachability reply and relays that refuse or grant."""

    def __init__(self, reply: cm.ReachabilityReply | Exception, grants: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.reply = reply
        self.grants = grants
        self.reserved: list[str] = []
        self.paths: dict[str, str] = {}

    def addrs(self) -> list[str]:
        return list(OWN)

    def local_port(self, peer: str) -> int | None:
        return 40000

    async def request(self, peer: str, name: str, msg: Any, reply_type: Any, *, timeout: float) -> cm.ReachabilityReply:
        assert isinstance(msg, cm.ReachabilityRequest) and msg.addrs == OWN and timeout <= 15.0
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    async def reserve(self, relay: str, *, timeout: float) -> str:
        self.reserved.append(relay)
        if relay not in self.grants:
            raise PeerUnavailable(relay.rsplit("/", 1)[-1], "reservation refused: no slots")
        return f"{relay}/p2p-circuit/p2p/{SELF}"

    def path_to(self, peer: str) -> str | None:
        return self.paths.get(peer)


def config(tmp_path: Path, **kw: Any) -> NodeConfig:
    return NodeConfig(coordinator=COORD, data_dir=tmp_path, **kw)


def run(host: FakeHost, cfg: NodeConfig, lines: list[str] | None = None) -> Reachability:
    return trio.run(lambda: establish(host, "coord", cfg, say=(lines if lines is not None else []).append))


def test_public_advertises_the_dialled_back_addresses_first(tmp_path: Path) -> None:
    seen = f"/ip4/203.0.113.7/tcp/4001/p2p/{SELF}"
    host = FakeHost(cm.ReachabilityReply(verdict="public", reason="ok", observed_ip="203.0.113.7", observed_port=4001, reachable=[seen]))
    r = run(host, config(tmp_path))
    assert r.verdict == "public" and r.addrs == [seen, *OWN] and not host.reserved
    assert r.rewrites_ports is True  # it saw port 4001, the node's own port on that connection is 40000


def test_unknown_carries_on_with_its_own_addresses(tmp_path: Path) -> None:
    # An older coordinator refuses a request kind it does not know: that is "unknown", not a failure.
    r = run(FakeHost(Refused("coord", "cannot decode coord.reachability_request")), config(tmp_path))
    assert r.verdict == "unknown" and r.addrs == OWN and "reachability check failed" in r.reason


def test_private_reserves_on_relay_via_first_and_advertises_only_the_circuit(tmp_path: Path) -> None:
    host = FakeHost(cm.ReachabilityReply(verdict="private", reason="no", relays=[RELAY_B]), grants={RELAY_B})
    lines: list[str] = []
    r = run(host, config(tmp_path, relay_via=[RELAY_A]), lines)
    assert host.reserved == [RELAY_A, RELAY_B]  # the user's relay first, then the coordinator's offers
    assert r.verdict == "private" and r.relay == RELAY_B and r.addrs == [f"{RELAY_B}/p2p-circuit/p2p/{SELF}"]
    assert r.failures == [f"{RELAY_A_ID[-8:]}: reservation refused: no slots"]
    assert lines == [f"this node is behind a NAT (private): reachable through relay {RELAY_B_ID[-8:]}"]


def test_private_without_a_slot_stops_with_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    host = FakeHost(cm.ReachabilityReply(verdict="private", reason="no", relays=[RELAY_B]))
    with pytest.raises(JoinError) as err:
        run(host, config(tmp_path, relay_via=[RELAY_A]))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == (
        "this node cannot be reached from the internet (the coordinator could not dial back TCP port 4001) and no relay gave it "
        f"a slot ({RELAY_A_ID[-8:]}: reservation refused: no slots; {RELAY_B_ID[-8:]}: reservation refused: no slots): open or forward TCP port 4001 "
        "to this machine, or pass --relay-via MULTIADDR of a relay (a coordinator started with --relay, or a public node joined with --relay)"
    )
    with pytest.raises(JoinError, match=r"no relay gave it a slot \(none was offered\)"):
        run(FakeHost(cm.ReachabilityReply(verdict="private", reason="no")), config(tmp_path))


def test_heartbeat_path() -> None:
    host = FakeHost(cm.ReachabilityReply(verdict="public", reason=""))
    assert heartbeat_path("public", host, ["a"]) == "direct"
    assert heartbeat_path("unknown", host, ["a"]) == ""
    assert heartbeat_path("private", host, []) == "relayed"
    host.paths = {"a": "relayed", "b": "hole-punched"}
    assert heartbeat_path("private", host, ["a"]) == "relayed"
    assert heartbeat_path("private", host, ["a", "b"]) == "hole-punched"
    host.paths = {"a": "relayed", "c": "direct"}  # a private node dials a public peer directly
    assert heartbeat_path("private", host, ["a", "c"]) == "direct"
    assert cm.Heartbeat(state="training", path="hole-punched").path == "hole-punched"
    with pytest.raises(ValidationError):
        cm.Heartbeat(state="training", path="teleported")


@pytest.mark.parametrize(
    ("relay", "why"),
    [
        ("/ip4/1.2.3.4/tcp/x/p2p/abc", "is not a valid multiaddr"),
        ("/ip4/1.2.3.4/tcp/4001", "must be a relay's direct multiaddr ending in /p2p/<peer id>"),
        (f"{RELAY_A}/p2p-circuit/p2p/{SELF}", "must be a relay's direct multiaddr"),
    ],
)
def test_relay_via_is_checked_at_once(relay: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="relay_via"):
        config(tmp_path, relay_via=[relay])
    try:
        config(tmp_path, relay_via=[relay])
    except ValidationError as err:
        assert why in str(err)
    assert config(tmp_path, relay_via=[RELAY_A], relay=True).relay_via == [RELAY_A]


def test_a_node_whose_relay_went_moves_to_another_it_knows_without_a_new_check(tmp_path: Path) -> None:
    from protolearn.node.reachability import move_relay

    host = FakeHost(cm.ReachabilityReply(verdict="private", reason="no", relays=[RELAY_A, RELAY_B]), grants={RELAY_A, RELAY_B})
    cfg = config(tmp_path)
    reach = run(host, cfg)
    assert reach.relay == RELAY_A and reach.offered == (RELAY_A, RELAY_B)
    lines: list[str] = []
    moved = trio.run(lambda: move_relay(host, cfg, reach, say=lines.append))
    assert moved is not None and moved.relay == RELAY_B and moved.verdict == "private"
    assert moved.addrs == [f"{RELAY_B}/p2p-circuit/p2p/{SELF}"] and "reachable through relay" in lines[-1]
    assert host.reserved == [RELAY_A, RELAY_B]  # the lost relay is not tried again
    host.grants = set()
    assert trio.run(lambda: move_relay(host, cfg, moved, say=lines.append)) is None  # then it asks the coordinator again
