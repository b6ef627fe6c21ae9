"""Request/response, streams and the gate between real libp2p hosts on 127.0.0.1."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import trio

from protolearn.errors import ConfigError
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError, Refused, WrongPeer
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import open_host
from protolearn.protocol.wire import Message


class Echo(Message):
    KIND: ClassVar[str] = "test_echo"
    text: str
    n: int


class EchoReply(Message):
    KIND: ClassVar[str] = "test_echo_reply"
    text: str
    from_peer: str


async def echo_handler(peer: str, req: Message) -> Message:
    assert isinstance(req, Echo)
    if req.text == "refuse me":
        raise Refused(peer, "asked to be refused")
    return EchoReply(text=req.text * req.n, from_peer=peer)


def test_request_response_between_two_hosts(open_hosts, run_trio):
    async def main():
        async with open_hosts(2) as (server, client):
            server.serve("echo", echo_handler, request_type=Echo)
            reply = await client.request(server.peer_id, "echo", Echo(text="ab", n=3), EchoReply)
            assert reply == EchoReply(text="ababab", from_peer=client.peer_id)
            # the full multiaddr works too, and a remote ErrorReply becomes Refused with its reason
            with pytest.raises(Refused, match="asked to be refused"):
                await client.request(server.addrs()[0], "echo", Echo(text="refuse me", n=1), EchoReply)
            assert server.requests_served == 1  # the refused one is not "served"

    run_trio(main)


def test_host_identity_and_addresses(run_trio):
    ident = Identity.generate()

    async def main():
        async with open_host(ident, ["/ip4/0.0.0.0/tcp/0"]) as host:
            assert host.peer_id == ident.peer_id
            addrs = host.addrs()
            assert addrs and all(a.endswith(f"/p2p/{ident.peer_id}") for a in addrs)
            assert addrs[0].startswith("/ip4/127.0.0.1/tcp/")
            assert not any("0.0.0.0" in a for a in addrs)
            # a second host on a taken port is a clear configuration error, not a silent share
            port = addrs[0].split("/")[4]
            with pytest.raises(ConfigError, match="Address already in use"):
                async with open_host(Identity.generate(), [f"/ip4/127.0.0.1/tcp/{port}"]):
                    pass
        # an error in the body comes out as itself, not wrapped in the nurseries' ExceptionGroup
        with pytest.raises(Refused, match="from the body"):
            async with open_host(Identity.generate()):
                raise Refused("local", "from the body")

    run_trio(main)


def test_connect_checks_the_peer_id(open_hosts, run_trio):
    async def main():
        async with open_hosts(2, introduce=False) as (a, b):
            assert await a.connect(b.addrs()[0]) == b.peer_id
            impostor = b.addrs()[0].replace(b.peer_id, Identity.generate().peer_id)
            async with open_hosts(1, introduce=False) as (c,):
                # the address answers, with another key: WrongPeer (a retry cannot help), not just unreachable
                with pytest.raises(WrongPeer, match="answered with another peer id"):
                    await c.connect(impostor, timeout=5)
                b_port = b.addrs()[0].split("/tcp/")[1].split("/")[0]
                with pytest.raises(PeerUnavailable) as nobody:
                    await c.connect(b.addrs()[0].replace(f"/tcp/{b_port}/", "/tcp/9/"), timeout=5)
                assert not isinstance(nobody.value, WrongPeer)
            with pytest.raises(PeerUnavailable, match="/p2p/"):
                await a.connect(b.addrs()[0].split("/p2p/")[0])

    run_trio(main)


def test_request_to_silent_handler_times_out(open_hosts, run_trio):
    async def slow(peer, req):
        await trio.sleep(30)
        return EchoReply(text="", from_peer=peer)

    async def main():
        async with open_hosts(2) as (server, client):
            server.serve("slow", slow, request_type=Echo)
            t0 = trio.current_time()
            with pytest.raises(PeerTimeout):
                await client.request(server.peer_id, "slow", Echo(text="x", n=1), EchoReply, timeout=0.5)
            # The 0.5 s timeout ended the wait, not the handler's 30 s; the margin is for a loaded machine.
            assert trio.current_time() - t0 < 10

    run_trio(main)


def test_banned_peer_is_refused(open_hosts, run_trio, caplog):
    caplog.set_level(logging.WARNING, logger="protolearn.protocol")

    async def main():
        async with open_hosts(3) as (server, bad, good):
            server.serve("echo", echo_handler, request_type=Echo)
            await bad.request(server.peer_id, "echo", Echo(text="a", n=1), EchoReply)
            server.ban(bad.peer_id, "sent a forged gradient")
            assert server.is_banned(bad.peer_id)
            # The first try may hit the connection the ban is closing; a redial is refused by the gate.
            for _ in range(3):
                with pytest.raises(ProtocolError):
                    await bad.request(server.peer_id, "echo", Echo(text="a", n=1), EchoReply, timeout=3)
            assert server.gate.rejected["banned"] >= 1
            assert all(r.peer == bad.peer_id for r in server.gate.recent if r.kind == "banned")
            # the server also refuses to call the banned peer, and others are still served
            with pytest.raises(Refused, match="banned"):
                await server.request(bad.peer_id, "echo", Echo(text="a", n=1), EchoReply)
            assert (await good.request(server.peer_id, "echo", Echo(text="g", n=2), EchoReply)).text == "gg"
            server.unban(bad.peer_id)
            assert (await bad.request(server.peer_id, "echo", Echo(text="b", n=1), EchoReply, timeout=5)).text == "b"

    run_trio(main)
    assert any("rejected peer=" in r.getMessage() and "banned" in r.getMessage() for r in caplog.records)


def test_inbound_stream_limit_resets_the_extra_stream(open_hosts, run_trio):
    async def main():
        async with open_hosts(2) as (server, client):
            release = trio.Event()
            both_in = trio.Event()
            entered = 0

            async def hold(peer, req):
                nonlocal entered
                entered += 1
                if entered == 2:
                    both_in.set()
                await release.wait()
                return EchoReply(text=req.text, from_peer=peer)

            server.serve("held", hold, request_type=Echo, max_inbound=2)
            results: list[str] = []

            async def call(i):
                results.append((await client.request(server.peer_id, "held", Echo(text=str(i), n=1), EchoReply)).text)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0)
                nursery.start_soon(call, 1)
                with trio.fail_after(15):
                    await both_in.wait()
                with pytest.raises(PeerUnavailable):
                    await client.request(server.peer_id, "held", Echo(text="x", n=1), EchoReply, timeout=3)
                assert server.gate.rejected["stream_limit"] == 1
                release.set()
            assert sorted(results) == ["0", "1"]

    run_trio(main)


def test_request_reaches_a_peer_that_restarted_on_the_same_address(open_hosts, run_trio):
    ident = Identity.generate()

    async def main():
        async with open_hosts(1) as (client,):
            async with open_host(ident) as server:
                server.serve("echo", echo_handler, request_type=Echo)
                addr = server.addrs()[0]
                assert (await client.request(addr, "echo", Echo(text="a", n=1), EchoReply)).text == "a"
            # the old connection is dead; py-libp2p would keep it and refuse to redial
            with pytest.raises(PeerUnavailable):
                await client.request(ident.peer_id, "echo", Echo(text="b", n=1), EchoReply, timeout=3)
            async with open_host(ident, [addr.split("/p2p/")[0]]) as server:
                server.serve("echo", echo_handler, request_type=Echo)
                reply = await client.request(ident.peer_id, "echo", Echo(text="c", n=1), EchoReply, timeout=5)
                assert reply.text == "c"

    run_trio(main)
