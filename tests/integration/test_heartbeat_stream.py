"""Heartbeats on one long-lived stream (protocol/coordination.py BEATS): a real coordinator and a real link.

A member's beats go on its heartbeat stream, not as a request each (a request on a new stream costs about
4x the CPU). A refusal on the stream still reaches the link's handling of refusals: a member the coordinator
no longer knows joins again, and beats on a new stream after the link's back-off.
"""

from __future__ import annotations

import time

import trio
from protolearn.coordinator.service import serve
from protolearn.node import coordinator_link
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.node.progress import Progress
from protolearn.node.replica_hashes import ReplicaHashes
from protolearn.protocol import coordination as cm
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import open_host
from protolearn.stages.config import default_run
from tests.integration.test_coordinator import FAST, RETRY, join_msg, wait_until


def test_beats_go_on_one_stream_and_a_refusal_there_still_makes_the_member_join_again(run_trio, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(coordinator_link, "BEATS_RETRY_S", 0.5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await nursery.start(lambda task_status: serve(default_run(), tmp_path, settings=FAST, task_status=task_status))
            async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
                link = CoordinatorLink(host, coord.addrs[0], retry=RETRY)
                await link.join(join_msg(host))
                replies: list[cm.HeartbeatReply] = []
                async with trio.open_nursery() as beats:
                    await beats.start(link.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0), replies.append)
                    await wait_until(lambda: len(replies) >= 2, timeout=10, what="two heartbeat replies")
                    served = coord.host.requests_served
                    await wait_until(lambda: len(replies) >= 8, timeout=10, what="eight heartbeat replies")
                    # Six more beats, none of them a request: all on the one stream the coordinator holds open.
                    assert coord.host.requests_served == served
                    assert coord.host.active_streams(cm.BEATS, host.peer_id) == 1
                    # The coordinator forgets the member: its next beat is refused on the stream, and the link
                    # joins again through its request path, as it would after an expiry.
                    coord.core.handle(host.peer_id, cm.Leave(reason="test"), time.time())
                    await wait_until(lambda: link.rejoins == 1 and coord.core.registry.is_live(host.peer_id), timeout=10, what="the rejoin")
                    seen = len(replies)
                    await wait_until(lambda: coord.host.active_streams(cm.BEATS, host.peer_id) == 1 and len(replies) >= seen + 3,
                                     timeout=10, what="beats on a new stream after the back-off")
                    beats.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_serving_the_state_beats_at_once_but_once_per_applied_step_however_often_it_is_asked(run_trio, tmp_path) -> None:
    """A taker checks a donor's state against the hashes its stage reported, so the donor reports its hash at
    once (issue 28). Anyone may ask a node for its state: asking again for the same step sends no extra beat."""
    slow = FAST.model_copy(update={"heartbeat_interval_s": 60.0, "expiry_s": 180.0})  # every beat after the first is an early one

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await nursery.start(lambda task_status: serve(default_run(), tmp_path, settings=slow, task_status=task_status))
            async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
                link = CoordinatorLink(host, coord.addrs[0], retry=RETRY)
                await link.join(join_msg(host))
                hashes = ReplicaHashes(link, Progress(tmp_path / "events.jsonl", name="donor", live=False), host.peer_id, applied=lambda: 5)
                replies: list[cm.HeartbeatReply] = []
                async with trio.open_nursery() as beats:
                    await beats.start(link.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0), replies.append)
                    await wait_until(lambda: len(replies) == 1, timeout=10, what="the first beat")
                    hashes.served(5)
                    await wait_until(lambda: len(replies) == 2, timeout=10, what="a beat at once for the served step")
                    for _ in range(20):  # the same step asked for again and again
                        hashes.served(5)
                        await trio.sleep(0.05)
                    assert len(replies) == 2
                    hashes.served(6)
                    await wait_until(lambda: len(replies) == 3, timeout=10, what="a beat for the next served step")
                    beats.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)
