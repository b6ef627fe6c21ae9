"""A host lives until its ``async with open_host(...)`` block exits, also while that block is cancelled.

``protolearn node join`` stops on SIGINT/SIGTERM by cancelling the nursery the whole node runs in,
then says goodbye to the coordinator from a shielded ``finally`` inside the host's block. That
goodbye needs the host's libp2p swarm. When the swarm's own tasks were cancelled along with the
node (as they were before the fix), the swarm closed its connections and stopped its service
manager, so the leave redialled into a stopped swarm (``LifecycleError: Cannot schedule task after
service has stopped``), failed, and the coordinator only noticed the node gone when it expired.
"""

from __future__ import annotations

import trio
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.members import LEFT
from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import open_host

from tests.integration.test_coordinator import join_msg, start

# Expiry far beyond the test's deadline: the node may only disappear by leaving.
SLOW_EXPIRY = CoordinatorSettings(heartbeat_interval_s=0.2, expiry_s=600.0, lease_s=1.0, housekeeping_interval_s=0.05)
RETRY = RetryPolicy(retry_for_s=3.0, request_timeout_s=3.0)


def test_a_cancelled_host_block_can_still_talk_in_its_cleanup(open_hosts, run_trio, fast_config):
    async def echo(peer: str, msg: cm.Leave) -> cm.LeaveReply:
        return cm.LeaveReply(released=[len(msg.reason)])

    async def main():
        async with open_hosts(1) as (server,):
            server.serve("echo", echo, request_type=cm.Leave)
            gone = trio.Event()
            server.on_connection = lambda peer, connected: gone.set() if not connected else None
            replies: list[object] = []

            async def client(*, task_status=trio.TASK_STATUS_IGNORED):
                async with open_host(Identity.generate(), config=fast_config) as host:
                    await host.request(server.addrs()[0], "echo", cm.Leave(reason="hi"), cm.LeaveReply)
                    try:
                        task_status.started()
                        await trio.sleep_forever()
                    finally:
                        # What a node does when it is stopped: one last request, shielded, with a deadline.
                        with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                            try:
                                replies.append(await host.request(server.peer_id, "echo", cm.Leave(reason="bye"), cm.LeaveReply))
                            except ProtocolError as err:
                                replies.append(err)

            async with trio.open_nursery() as nursery:
                await nursery.start(client)
                nursery.cancel_scope.cancel()  # a signal stops everything the client runs in
            assert replies == [cm.LeaveReply(released=[3])]
            # Leaving the block still closes the host: the server sees the connection go.
            with trio.fail_after(5):
                await gone.wait()

    run_trio(main, timeout=30)


def test_a_stopped_node_leaves_the_coordinator_instead_of_expiring(run_trio, tmp_path, fast_config):
    """The shape of ``protolearn node join``: join, heartbeat, then a signal cancels it all."""

    async def main():
        async with trio.open_nursery() as coord_nursery:
            coord = await start(coord_nursery, tmp_path, SLOW_EXPIRY)
            left: list[object] = []
            peer: list[str] = []

            async def node(*, task_status=trio.TASK_STATUS_IGNORED):
                async with open_host(Identity.generate(), config=fast_config) as host:
                    peer.append(host.peer_id)
                    link = CoordinatorLink(host, coord.addrs[0], retry=RETRY)
                    await link.join(join_msg(host))
                    try:
                        async with trio.open_nursery() as beats:
                            await beats.start(link.heartbeat_loop, lambda: cm.Heartbeat(state="syncing", throughput=100.0))
                            task_status.started()
                            await trio.sleep_forever()
                    finally:
                        with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                            try:
                                left.append(await link.leave("stopped"))
                            except ProtocolError as err:
                                left.append(err)

            async with trio.open_nursery() as cli:  # the CLI's main nursery
                await cli.start(node)
                assert coord.core.registry.is_live(peer[0])
                cli.cancel_scope.cancel()  # what the CLI's signal watcher does on SIGTERM
            assert left == [[]]  # the leave was answered (no tickets were leased)
            assert coord.core.registry.members[peer[0]].status == LEFT  # it left; it did not expire
            coord_nursery.cancel_scope.cancel()

    run_trio(main, timeout=30)


def test_a_peers_closed_connection_is_told_once_as_soon_as_it_closes(open_hosts, run_trio, fast_config):
    """Issue 28: py-libp2p notifies a closed connection only after closing its muxer, resetting its streams and
    sleeping 0.1 s, and the coordinator's commit barrier (and stage 0's restart of tickets sent to a dead peer)
    waited that out after every crash. The host now tells the close as soon as the connection is marked closed
    (at least those 0.1 s before py-libp2p's notification, by trio's own clock), and tells it once."""
    from libp2p.abc import INotifee

    async def echo(peer: str, msg: cm.Leave) -> cm.LeaveReply:
        return cm.LeaveReply(released=[len(msg.reason)])

    async def main():
        async with open_hosts(1) as (server,):
            server.serve("echo", echo, request_type=cm.Leave)
            told: list[tuple[str, bool, float]] = []
            notified: list[float] = []
            gone = trio.Event()
            server.on_connection = lambda peer, up: told.append((peer, up, trio.current_time()))

            class Late(INotifee):  # py-libp2p's own notification, as any notifee gets it
                async def disconnected(self, network, conn) -> None:
                    notified.append(trio.current_time())
                    gone.set()

                async def connected(self, network, conn) -> None: ...
                async def opened_stream(self, network, stream) -> None: ...
                async def closed_stream(self, network, stream) -> None: ...
                async def listen(self, network, multiaddr) -> None: ...
                async def listen_close(self, network, multiaddr) -> None: ...

            server._lp.get_network().register_notifee(Late())
            async with open_host(Identity.generate(), config=fast_config) as client:
                await client.request(server.addrs()[0], "echo", cm.Leave(reason="hi"), cm.LeaveReply)
                me = client.peer_id
            with trio.fail_after(5):
                await gone.wait()
            await trio.sleep(0.2)  # a second tell would come right after py-libp2p's notification
            assert [(p, up) for p, up, _ in told] == [(me, True), (me, False)], told
            assert notified[0] - told[1][2] >= 0.09, (told, notified)

    run_trio(main, timeout=30)
