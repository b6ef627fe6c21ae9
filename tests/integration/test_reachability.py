"""The reachability check on loopback: a real coordinator dials real node hosts back (issue 14)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.node.join import join_coordinator
from protolearn.protocol import coordination as cm
from protolearn.protocol.status_schema import Status
from protolearn.protocol.errors import Refused
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import Host, RelayLimits, open_host
from tests.integration.conftest import FAST_CONFIG
from tests.integration.test_coordinator import RETRY, start



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ask(node: Host, coordinator: str, addrs: list[str], timeout: float = 15.0) -> cm.ReachabilityReply:
    return await node.request(coordinator, cm.COORDINATOR, cm.ReachabilityRequest(addrs=addrs), cm.ReachabilityReply, timeout=timeout)


def test_a_listening_node_is_public_and_was_dialled_on_a_fresh_connection(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            async with open_host(Identity.generate(), config=FAST_CONFIG) as node:
                inbound: list[str] = []
                node.on_connection = lambda peer, up: inbound.append(peer) if up else None
                await node.connect(coord.addrs[0])
                t0 = trio.current_time()
                reply = await ask(node, coord.peer_id, node.addrs())
                took = trio.current_time() - t0
                assert reply.verdict == "public", reply.reason
                assert reply.reachable == [a for a in node.addrs() if a.startswith("/ip4/127.0.0.1/")]
                assert reply.observed_ip == "127.0.0.1" and reply.observed_port == node.local_port(coord.peer_id)
                assert reply.relays == []  # the coordinator does not relay, and no member offers to
                # The dial-back came from the checker, a peer other than the coordinator, on its own connection.
                assert coord.checker is not None and coord.checker.peer_id != coord.peer_id
                assert coord.checker.peer_id in inbound
                assert coord.core.reachability.verdict_of(node.peer_id) == "public"
                assert took < 2.0, f"a loopback check took {took:.2f} s"
                # The checker hangs up soon after it replied; the node's own connection stays.
                with trio.fail_after(5):
                    while node.observed_addr(coord.checker.peer_id) is not None:
                        await trio.sleep(0.05)
                assert node.observed_addr(coord.peer_id) is not None
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_port_nobody_listens_on_or_another_peers_port_is_private(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            async with open_host(Identity.generate(), config=FAST_CONFIG) as node, open_host(Identity.generate(), config=FAST_CONFIG) as other:
                await node.connect(coord.addrs[0])
                dead = free_port()
                reply = await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{dead}/p2p/{node.peer_id}"])
                assert reply.verdict == "private" and str(dead) in reply.reason and reply.reachable == []
                # Another peer answers at that port: Noise shows its key, so that is no proof this node is reachable.
                other_port = int(other.addrs()[0].split("/")[4])
                reply = await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{other_port}/p2p/{node.peer_id}"])
                assert reply.verdict == "private", reply.reason
                # Addresses of other machines are never dialled, only their ports at the node's own IP.
                reply = await ask(node, coord.peer_id, [f"/ip4/10.255.255.1/tcp/{dead}"])
                assert reply.verdict == "private" and reply.observed_ip == "127.0.0.1"
                # With no TCP port at all there is nothing to dial.
                reply = await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/udp/{dead}"])
                assert reply.verdict == "unknown"
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_one_check_per_peer_at_a_time_and_heartbeats_are_served_meanwhile(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            # A TCP listener that accepts and never speaks: the dial-back stalls until its deadline.
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            silent_port = listeners[0].socket.getsockname()[1]
            nursery.start_soon(trio.serve_listeners, _hold, listeners)
            async with open_host(Identity.generate(), config=FAST_CONFIG) as node, open_host(Identity.generate(), config=FAST_CONFIG) as member:
                await node.connect(coord.addrs[0])
                link = CoordinatorLink(member, coord.addrs[0], retry=RETRY)
                await link.join(cm.Join(addrs=[a.rsplit("/p2p/", 1)[0] for a in member.addrs()], throughput=100.0))
                slow: list[cm.ReachabilityReply] = []

                async def slow_check() -> None:
                    slow.append(await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{silent_port}"]))

                async with trio.open_nursery() as checks:
                    checks.start_soon(slow_check)
                    with trio.fail_after(5):
                        while not coord.core.reachability.running(node.peer_id):
                            await trio.sleep(0.01)
                    with pytest.raises(Refused, match="already running"):
                        await ask(node, coord.peer_id, node.addrs())
                    t0 = trio.current_time()
                    await link.heartbeat(cm.Heartbeat(state="training"))
                    assert trio.current_time() - t0 < 1.0, "a heartbeat waited for the dial-back"
                assert slow[0].verdict == "private"  # the silent port timed out
                reply = await ask(node, coord.peer_id, node.addrs())  # and the next check may run
                assert reply.verdict == "public"
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


async def _hold(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


def test_a_joining_node_is_checked_and_registered_with_the_coordinators_verdict(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            async with open_host(Identity.generate(), config=FAST_CONFIG) as node:
                config = NodeConfig(coordinator=coord.addrs[0], data_dir=tmp_path / "n", device="cpu", coordinator_wait_s=0)
                link, joined, _run, reach = await join_coordinator(node, config)
                assert reach.verdict == "public" and reach.addrs[0].startswith("/ip4/127.0.0.1/")
                member = coord.core.registry.members[node.peer_id]
                assert member.reachability == "public" and not member.relay
                await link.heartbeat(cm.Heartbeat(state="training", path="direct"))
                status = await node.request(coord.peer_id, cm.COORDINATOR, cm.StatusRequest(), Status)
                (view,) = [n for n in status.nodes if n.peer_id == node.peer_id]
                assert (view.reachability, view.path) == ("public", "direct")
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_relaying_coordinator_offers_itself_and_gives_a_private_node_a_slot(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c", relay=True)
            assert coord.host.relaying
            async with open_host(Identity.generate(), config=FAST_CONFIG) as node, open_host(Identity.generate(), config=FAST_CONFIG) as stranger:
                # Only nodes its check found private may reserve: an identity that never asked is refused.
                with pytest.raises(Refused, match="PERMISSION_DENIED"):
                    await stranger.reserve(coord.addrs[0], timeout=5)
                await node.connect(coord.addrs[0])
                reply = await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{free_port()}"])
                assert reply.verdict == "private" and reply.relays[0] == coord.addrs[0]
                circuit = await node.reserve(reply.relays[0], timeout=5)
                assert circuit == f"{coord.addrs[0]}/p2p-circuit/p2p/{node.peer_id}"
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_public_member_that_offers_to_relay_is_offered_to_private_joiners(tmp_path: Path, run_trio: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            async with (
                open_host(Identity.generate(), config=FAST_CONFIG, relay=RelayLimits()) as relay,
                open_host(Identity.generate(), config=FAST_CONFIG) as node,
            ):
                config = NodeConfig(coordinator=coord.addrs[0], data_dir=tmp_path / "r", device="cpu", relay=True)
                _link, _joined, _run, reach = await join_coordinator(relay, config)
                assert reach.verdict == "public" and coord.core.registry.members[relay.peer_id].relay
                await node.connect(coord.addrs[0])
                reply = await ask(node, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{free_port()}"])
                assert reply.verdict == "private" and reply.relays == [reach.addrs[0]]
                circuit = await node.reserve(reply.relays[0], timeout=5)
                assert circuit.endswith(f"/p2p-circuit/p2p/{node.peer_id}")
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_checks_past_the_slots_and_the_waiting_room_are_answered_busy_at_once(tmp_path: Path, run_trio: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from protolearn.coordinator import service

    monkeypatch.setattr(service, "MAX_CHECKS", 1)
    monkeypatch.setattr(service, "MAX_CHECK_WAITERS", 0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path / "c")
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            silent_port = listeners[0].socket.getsockname()[1]
            nursery.start_soon(trio.serve_listeners, _hold, listeners)
            async with open_host(Identity.generate(), config=FAST_CONFIG) as a, open_host(Identity.generate(), config=FAST_CONFIG) as b:
                await a.connect(coord.addrs[0])
                await b.connect(coord.addrs[0])
                async with trio.open_nursery() as checks:
                    checks.start_soon(ask, a, coord.peer_id, [f"/ip4/127.0.0.1/tcp/{silent_port}"])
                    with trio.fail_after(5):
                        while not coord.core.reachability.running(a.peer_id):
                            await trio.sleep(0.01)
                    t0 = trio.current_time()
                    reply = await ask(b, coord.peer_id, b.addrs())
                    assert reply.verdict == "unknown" and "busy" in reply.reason
                    assert trio.current_time() - t0 < 1.0
                assert coord.core.reachability.verdict_of(b.peer_id) == "unknown"  # busy is no verdict on b
                assert (await ask(b, coord.peer_id, b.addrs())).verdict == "public"  # once the slot is free
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)
