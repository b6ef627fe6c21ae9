"""The coordinator service on real loopback hosts, driven by N real protocol clients (CoordinatorLink)."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.wait_slots import MIN_AGE_S
from protolearn.coordinator.service import Running, serve
from protolearn.node.coordinator_link import CoordinatorBusy, CoordinatorLink, CoordinatorRefused, RetryPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.errors import PeerTimeout, ProtocolError, Refused
from protolearn.stages.config import default_run

FAST = CoordinatorSettings(
    heartbeat_interval_s=0.2,
    expiry_s=1.0,
    lease_s=1.0,
    housekeeping_interval_s=0.05,
    rate_per_s=500,
    rate_burst=500,
    ban_notice_s=0.5,
)
RETRY = RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0)
# Leases and membership that outlast the test, and a short grace after a closed connection: what ends a lease
# early is the dead member's closed connection, never its lease's or its membership's expiry.
LONG_LEASES = FAST.model_copy(update={"lease_s": 30.0, "expiry_s": 30.0, "disconnect_grace_s": 0.3})


def coord_links(coord: Running, *hosts) -> list[CoordinatorLink]:
    return [CoordinatorLink(h, coord.addrs[0], retry=RETRY) for h in hosts]


def join_msg(host, throughput: float = 100.0) -> cm.Join:
    return cm.Join(addrs=[a.rsplit("/p2p/", 1)[0] for a in host.addrs()], throughput=throughput, name="t")


async def start(nursery: trio.Nursery, data_dir: Path, settings: CoordinatorSettings = FAST, **kw) -> Running:
    return await nursery.start(
        lambda task_status: serve(default_run(), data_dir, settings=settings, task_status=task_status, **kw)
    )


async def wait_until(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll ``predicate`` (cheap, in-process state) until it holds; fail after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class LeaseCount:
    """Counts the Lease requests the coordinator core answers (a held lease is answered again as tickets free)."""

    def __init__(self, core: Any) -> None:
        self.count = 0
        inner = core.handle

        def handle(peer: str, msg: Any, *args: Any, **kw: Any) -> Any:
            self.count += isinstance(msg, cm.Lease)
            return inner(peer, msg, *args, **kw)

        core.handle = handle


class LongPolls:
    """Counts the WaitStep long polls the coordinator took in, so a test can wait until one is parked.

    The service calls ``core.check_wait`` first and then, without yielding to trio, parks the request on
    its change event; so once the count moved, the long poll is waiting.
    """

    def __init__(self, core: Any) -> None:
        self.count = 0
        self._moved = trio.Event()
        inner = core.check_wait

        def check_wait(*args: Any) -> None:
            inner(*args)
            self.count += 1
            self._moved.set()
            self._moved = trio.Event()

        core.check_wait = check_wait

    async def wait_for(self, count: int, timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            while self.count < count:
                await self._moved.wait()


async def scrape(port: int) -> str:
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    return data.decode()


def test_nodes_join_heartbeat_train_steps_leave_and_expire(open_hosts, run_trio, tmp_path):
    B = default_run().batch.microbatches_per_step

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, metrics_port=0)
            polls = LongPolls(coord.core)
            async with open_hosts(4, introduce=False) as hosts:
                links = coord_links(coord, *hosts)
                replies = [await link.join(join_msg(h)) for link, h in zip(links, hosts, strict=True)]
                assert sorted(r.stage for r in replies) == [0, 0, 1, 1]
                assert all(r.run_hash == default_run().run_hash() for r in replies)
                by_stage = {s: [lk for lk, r in zip(links, replies, strict=True) if r.stage == s] for s in (0, 1)}
                s0, s1 = by_stage[0], by_stage[1]

                async with trio.open_nursery() as beats:
                    for lk in links:
                        await beats.start(lk.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0))
                    # Each link learns the member list from its heartbeat replies.
                    await wait_until(lambda: all(len(lk.members) == 4 for lk in links), timeout=10, what="every link to see 4 members")
                    status = await links[0].status()
                    assert status.verdict == "healthy", status.verdict_reason

                    latencies: list[float] = []
                    # Two steps: both stage-0 replicas lease in blocks and complete through stage 1.
                    for step in range(2):
                        waited: list[cm.StepInfo] = []
                        closed_at: list[float] = []

                        async def waiter(lk=s1[0], step=step, waited=waited, closed_at=closed_at):
                            waited.append(await lk.wait_step(step, timeout_s=10.0))
                            closed_at.append(trio.current_time())

                        async with trio.open_nursery() as work:
                            parked = polls.count + 1
                            work.start_soon(waiter)
                            await polls.wait_for(parked)  # the long poll waits before the step closes
                            done = 0
                            while done < B:
                                for i, lk in enumerate(s0):
                                    lease = await lk.lease(2)
                                    assert len(lease.nonces) == len(lease.indices)
                                    for idx, nonce in zip(lease.indices, lease.nonces):
                                        last_hop = s1[idx % 2].host
                                        route = [lk.host.peer_id, last_hop.peer_id]
                                        # The last stage's signed ack, as its router sends it back with the gradient.
                                        ack = last_hop.sign(ack_statement(default_run().run_hash(), lease.step, idx, route, 2.0 + idx, nonce))
                                        reply = await lk.complete(lease.step, idx, route, 2.0 + idx, ack, nonce)
                                        done += 1
                                        last = trio.current_time()
                                        assert reply.step_closed == (done == B)
                        info = waited[0]
                        assert info.closed and info.step == step and info.num_tickets == B
                        acc = {a.stage: {p.peer_id: p.tickets for p in a.peers} for a in info.accounting}
                        for stage in (0, 1):
                            assert sorted(t for ts in acc[stage].values() for t in ts) == list(range(B))
                        assert info.loss == sum(2.0 + i for i in range(B)) / B
                        # The long poll answered as soon as the step closed, not when its 10 s ran out;
                        # the margin is for a loaded 2-core machine.
                        assert closed_at[0] - last < 5.0, closed_at[0] - last
                        latencies.append(closed_at[0] - last)
                        # The commit barrier: the step commits once every stage averaged it and every live
                        # replica holds the result (a participant, or a replica that fetched it).
                        committed: list[cm.StepInfo] = []

                        async def commit_waiter(lk=s0[1], step=step, committed=committed):
                            committed.append(await lk.wait_step(step, timeout_s=10.0, until="committed"))

                        async with trio.open_nursery() as work:
                            parked = polls.count + 1
                            work.start_soon(commit_waiter)
                            await polls.wait_for(parked)
                            assert not (await s0[0].averaged(step, info.revision)).committed
                            # An observation window, not a synchronisation: a wrong early answer to the
                            # parked long poll would arrive within it. (A slow machine only makes it miss.)
                            await trio.sleep(0.1)
                            assert committed == []  # stage 1 has not averaged yet
                            assert not (await s1[0].averaged(step, info.revision)).committed
                            assert not (await s0[1].averaged(step, info.revision)).committed
                            assert committed == []  # the last live replica does not hold the result yet
                            assert (await s1[1].averaged(step, info.revision)).committed
                        assert committed[0].committed and committed[0].revision == info.revision
                    beats.cancel_scope.cancel()
                print(f"step-close to long-poll reply: {[round(x * 1000, 1) for x in latencies]} ms")
                head, _, body = (await scrape(coord.metrics_port)).partition("\r\n\r\n")
                assert head.startswith("HTTP/1.1 200 OK")
                samples = {
                    (x.name, tuple(x.labels.items())): x.value for f in text_string_to_metric_families(body) for x in f.samples
                }
                assert samples[("protolearn_step", ())] == 2 and samples[("protolearn_nodes", ())] == 4
                assert samples[("protolearn_stage_replicas", (("stage", "1"),))] == 2

                # A graceful leave, then a silent node expires.
                assert await s1[1].leave("done") == []
                await wait_until(lambda: not list(coord.core.registry.live()), timeout=FAST.expiry_s + 15, what="every node to expire")
                status = await links[0].status()
                assert status.step == 2 and [p.step for p in status.loss_history] == [0, 1]
                assert status.nodes == []  # everyone stopped heartbeating: all expired
                assert status.verdict == "halted"
                # An expired node's next request (not a heartbeat: a process starved between its join and its
                # first beat asks something else first) joins it again, to its old stage, and is answered.
                before = s0[0].rejoins
                assert await s0[0].release(2, []) == []
                assert s0[0].rejoins == before + 1 and s0[0].stage == 0
                assert coord.core.registry.is_live(s0[0].host.peer_id)
                again = await s0[0].join(join_msg(s0[0].host))
                assert again.rejoined and again.stage == 0
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_coordinator_refuses_abuse_and_keeps_serving(open_hosts, run_trio, tmp_path, caplog):
    """Unknown/malformed requests, second join, heartbeats from strangers and the banned, reports
    about unknown peers, completions of unleased tickets and floods: each refused with a logged reason."""
    caplog.set_level(logging.INFO)
    # The flood below (40 requests in a row) must outrun the refill: with a burst of 20 and 2/s it is
    # refused unless 40 requests take over 10 s, so a loaded machine still floods (at 20/s a request
    # slower than 25 ms on average never emptied the bucket).
    settings = FAST.model_copy(update={"rate_per_s": 2.0, "rate_burst": 20.0, "expiry_s": 30.0})

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            core = coord.core
            async with open_hosts(5, introduce=False) as hosts:
                good, stage1, stranger, flooder, accused = hosts
                links = coord_links(coord, *hosts)
                lg, l1, lstr, lflood, lacc = links
                # A refusal over the rate decides nothing, so a link asks again for retry_for_s; this one does not.
                lflood.retry = RetryPolicy(retry_for_s=0.0, request_timeout_s=5.0)
                await lg.join(join_msg(good))
                await l1.join(join_msg(stage1))
                await lflood.join(join_msg(flooder))
                await lacc.join(join_msg(accused))
                before = (core.ledger.step, sorted(m.peer_id for m in core.registry.live()))

                async def refused(call, code: str) -> None:
                    try:
                        await call
                    except Exception as err:  # noqa: BLE001 - the assertion below names what was expected
                        got = getattr(err, "code", None) or str(err)
                        assert got == code or f"Refusal: {code}:" in got, f"expected {code}, got {err!r}"
                    else:
                        raise AssertionError(f"expected refusal {code}")

                # malformed bytes and an unknown message kind on the coordinator protocol
                for raw in (b"\x00\x00\x00\x00\x00\x00\x00\x05hello", b"\xff" * 7):
                    async with stranger.open_stream(coord.addrs[0], cm.COORDINATOR) as s:
                        await s.raw.write(raw)
                        await s.close()  # half-close: a truncated frame reads as EOF on the server
                        try:
                            await s.receive(cm.JoinReply, timeout=5)
                        except Exception as err:  # noqa: BLE001 - any typed failure is fine, a reply is not
                            assert type(err).__name__ in ("PeerUnavailable", "PeerTimeout", "ProtocolError", "Refused"), err
                        else:
                            raise AssertionError("malformed request got a reply")
                try:
                    await stranger.request(coord.addrs[0], cm.COORDINATOR, cm.StepInfo(
                        step=0, closed=False, revision=0, loss=None, num_tickets=1, accounting=[], open_step=0,
                    ), cm.JoinReply, timeout=5)
                except Refused as err:
                    assert "unexpected message kind 'coord.step_info'" in err.reason
                else:
                    raise AssertionError("a reply-kind sent as a request was answered")

                # a second join of a live peer (raw, without the link's rejoin logic)
                await refused(_raw_join(good, coord), "already_joined")
                # heartbeats, leases and completions from a peer that never joined
                await refused(lstr.heartbeat(cm.Heartbeat(state="training")), "not_member")
                await refused(lstr.lease(1), "not_member")
                # completion of a ticket the sender never leased
                stage0 = lg if lg.stage == 0 else l1
                other = l1 if stage0 is lg else lg
                await refused(stage0.complete(0, 0, [stage0.host.peer_id, other.host.peer_id], 1.0), "not_leaseholder")
                # a report about an unknown peer
                await refused(lg.report("12D3KooWNobodyNobodyNobodyNobodyNobodyNobodyNobody", "bad"), "unknown_peer")
                # a flood beyond the rate limit is refused, others are unaffected
                codes = []
                for _ in range(40):
                    try:
                        await lflood.heartbeat(cm.Heartbeat(state="training"))
                    except Exception as err:  # noqa: BLE001
                        codes.append(getattr(err, "code", repr(err)))
                assert codes and set(codes) == {"rate_limited"}
                assert isinstance(await lg.heartbeat(cm.Heartbeat(state="training")), cm.HeartbeatReply)

                # a ban: for ban_notice_s the banned peer's requests are refused with the reason (so the
                # node can say why it stopped), then the gate refuses it at connection time
                core.ban(accused.peer_id, "test ban", time.time())
                with pytest.raises(CoordinatorRefused, match="test ban") as refusal:
                    await lacc.heartbeat(cm.Heartbeat(state="training"))
                assert refusal.value.code == "banned"
                await trio.sleep(0.6)
                await lg.heartbeat(cm.Heartbeat(state="training"))  # commits and gates the ban
                try:
                    await lacc.heartbeat(cm.Heartbeat(state="training"))
                except Exception as err:  # noqa: BLE001
                    assert type(err).__name__ in ("PeerUnavailable", "CoordinatorRefused", "PeerTimeout"), err
                else:
                    raise AssertionError("banned peer was answered")
                assert coord.host.is_banned(accused.peer_id)

                # state is intact and the coordinator still serves
                after = (core.ledger.step, sorted(m.peer_id for m in core.registry.live()))
                assert after[0] == before[0]
                assert sorted(set(before[1]) - {accused.peer_id}) == after[1]
                assert core.ledger.remaining() == default_run().batch.microbatches_per_step
                lease = await stage0.lease(1)
                assert lease.indices == [0]
                status = await lg.status()
                assert [b.peer_id for b in status.bans] == [accused.peer_id]
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=90)
    text = caplog.text
    # Each refusal is logged: in full as its peer's first in the interval, else counted by code in
    # the peer's summary line, which also names the last one in full.
    for code in ("already_joined", "not_member", "not_leaseholder", "unknown_peer", "rate_limited"):
        assert f"code={code}" in text or re.search(rf"refused peer=\S+: \d+ more in .*\b{code} \d+", text), code
    # the flood cost a line and a summary in the coordinator's log and in its host's, not one per request
    for logger in ("protolearn.coordinator", "protolearn.protocol"):
        flood = [r.getMessage() for r in caplog.records if r.name == logger and "rate_limited" in r.getMessage()]
        assert 1 <= len(flood) <= 2, flood
    assert "rejected peer=" in text  # the transport logged the malformed requests


async def _raw_join(host, coord: Running):
    return await host.request(coord.addrs[0], cm.COORDINATOR, join_msg(host), cm.JoinReply, timeout=5)


def test_busy_is_asked_again_and_never_read_as_no(open_hosts, run_trio, tmp_path, caplog):
    """Issue 27: a node read any refusal of "did the step reopen?" as "no", busy included, and then applied
    a step missing tickets (I1) or resynced. With the coordinator's one long-poll slot taken, another
    member's long poll is refused ``busy``: its link asks again, and once the slot's poll has lasted
    MIN_AGE_S, takes its slot (the busier peer's poll is answered early, with the step as it stands) and gets
    its answer, long before that poll would have ended. Asked for less long than that, it raises
    CoordinatorBusy, a timeout, never a refusal."""
    caplog.set_level(logging.INFO, logger="protolearn.node")
    settings = FAST.model_copy(update={"max_concurrent_waits": 1, "expiry_s": 30.0})

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            polls = LongPolls(coord.core)
            async with open_hosts(2, introduce=False) as (a, b):
                la, lb = coord_links(coord, a, b)
                await la.join(join_msg(a))
                await lb.join(join_msg(b))
                # Answered: a's poll (10 s, on step 0, which stays open) gives its slot up once it is MIN_AGE_S old.
                answered: dict[str, Any] = {}

                async def a_polls() -> None:
                    answered["a"] = await la.wait_step(0, timeout_s=10.0)
                    answered["a_at"] = trio.current_time()

                async with trio.open_nursery() as inner:
                    seen = polls.count
                    inner.start_soon(a_polls)
                    await polls.wait_for(seen + 1)
                    parked = trio.current_time()
                    info = await lb.wait_step(0, timeout_s=0.2)
                    took = trio.current_time() - parked
                assert isinstance(info, cm.StepInfo) and not info.closed
                assert MIN_AGE_S / 2 < took < 5.0, f"b was answered {took:.2f} s after a parked: once a's poll was old enough, not at its end"
                early = answered["a"]
                assert isinstance(early, cm.StepInfo) and not early.closed, "a's poll was answered early, with the step as it stands"
                assert answered["a_at"] - parked < 5.0
                # Not answered in time: b asks for less long than a's fresh poll takes to give its slot up.
                lb.retry = RetryPolicy(retry_for_s=0.3, request_timeout_s=5.0)
                async with trio.open_nursery() as inner:
                    seen = polls.count
                    inner.start_soon(lambda: la.wait_step(0, timeout_s=1.5))
                    await polls.wait_for(seen + 1)
                    with pytest.raises(CoordinatorBusy) as busy:
                        await lb.wait_step(0, timeout_s=0.2)
                    assert busy.value.code == "busy" and not isinstance(busy.value, Refused)
                    assert isinstance(busy.value, PeerTimeout), "no answer, which callers treat as 'ask again'"
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=30)
    asked_again = [r.getMessage() for r in caplog.records if "coordinator busy (busy:" in r.getMessage()]
    assert asked_again, "b was refused busy and asked again"


def test_sybil_members_holding_every_long_poll_slot_never_shut_a_node_out(open_hosts, run_trio, tmp_path):
    """Issue 27 (abuse bench ``long_poll_slots``): members that each hold as many long polls as the transport
    lets one peer open, on a step that no change answers, kept every other member's polls refused ``busy`` until
    theirs ended: training stopped for as long as they liked. Now a member that waits on fewer things than the
    busiest takes one of its slots, so the node's questions are answered while the Sybils re-poll."""
    settings = FAST.model_copy(update={"max_concurrent_waits": 8, "expiry_s": 30.0})
    never = cm.WaitStep(step=0, min_revision=2**30, timeout_s=cm.MAX_WAIT_S)

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            polls = LongPolls(coord.core)
            async with open_hosts(3, introduce=False) as (s1, s2, node):
                links = coord_links(coord, s1, s2, node)
                for link in links:
                    await link.join(join_msg(link.host))
                sybil_answers: list[cm.StepInfo] = []

                async def hold(h) -> None:
                    while True:  # re-poll at once, as an attacker would
                        try:
                            sybil_answers.append(await h.request(links[0].peer, cm.COORDINATOR, never, cm.StepInfo, timeout=40))
                        except Refused:
                            await trio.sleep(0.01)

                async with trio.open_nursery() as sybils:
                    seen = polls.count
                    for h in (s1, s2):
                        for _ in range(8):
                            sybils.start_soon(hold, h)
                    await polls.wait_for(seen + 8)  # every slot is a Sybil's
                    for _ in range(3):  # the node's questions, one after another
                        t0 = trio.current_time()
                        info = await links[2].wait_step(0, min_revision=2, timeout_s=0.5)
                        assert isinstance(info, cm.StepInfo) and trio.current_time() - t0 < 5.0
                    sybils.cancel_scope.cancel()
                assert sybil_answers and all(isinstance(i, cm.StepInfo) and not i.closed for i in sybil_answers), (
                    "the polls that gave their slots up were answered, with the step as it stands")
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_dead_stage0_nodes_leases_go_to_another_replica_long_before_they_expire(open_hosts, run_trio, tmp_path):
    """The coordinator sees the dead node's connection close and ends its leases after a short grace."""
    settings = LONG_LEASES

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            async with open_hosts(2, introduce=False) as (b, c):
                lb, lc = coord_links(coord, b, c)
                async with open_hosts(1, introduce=False) as (a,):
                    (la,) = coord_links(coord, a)
                    assert (await la.join(join_msg(a))).stage == 0
                    stages = {(await lk.join(join_msg(lk.host))).stage: lk for lk in (lb, lc)}
                    other = stages[0]
                    held = (await la.lease(2)).indices
                    assert len(held) == 2
                # a's host is closed: like a SIGKILL, its connections drop without a Leave.
                died = trio.current_time()
                got: list[int] = []
                while not set(held) <= set(got) and trio.current_time() - died < 20.0:
                    got += (await other.lease(4)).indices
                    await trio.sleep(0.05)
                took = trio.current_time() - died
                print(f"dead node's leases re-issued after {took:.2f} s (lease_s={settings.lease_s})")
                # Long before the 30 s lease ran out (the grace is 0.3 s; the margin is for a loaded machine).
                assert took < 10.0
                assert coord.core.registry.is_live(a.peer_id)  # not expired: only its leases ended
                # A live member's idle connection stays up: its leases are not ended early. An
                # observation window (three disconnect graces), not a synchronisation.
                await trio.sleep(1.0)
                mine = coord.core.ledger.holdings(other.host.peer_id)
                assert set(held) <= set(mine)
                assert all(coord.core.ledger.tickets[i].expires_at > time.time() + 20 for i in mine)
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=30)


def test_a_waiting_lease_is_answered_as_soon_as_a_dead_replicas_tickets_free(open_hosts, run_trio, tmp_path):
    """Issue 28: a stage-0 replica SIGKILLed mid-step held tickets. The coordinator ended its leases once its connection
    had stayed closed for the grace, and the surviving replica, which had been asking for tickets with a growing
    back-off, took them 0.49 s later still (bench.py recovery, kill phase 0.5). A lease may now ask the coordinator
    to hold it until a ticket frees: the survivor's one request is answered with the dead replica's tickets, and a
    wait in which nothing frees is answered empty when its time is up."""
    settings = LONG_LEASES

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            async with open_hosts(2, introduce=False) as (b, c):
                lb, lc = coord_links(coord, b, c)
                async with open_hosts(1, introduce=False) as (a,):
                    (la,) = coord_links(coord, a)
                    assert (await la.join(join_msg(a))).stage == 0
                    # Alone in stage 0, its share is the whole step: it holds every ticket.
                    held = (await la.lease(4)).indices
                    assert held == [0, 1, 2, 3]
                    stages = {(await lk.join(join_msg(lk.host))).stage: lk for lk in (lb, lc)}
                    other = stages[0]
                    t0 = trio.current_time()
                    idle = await other.lease(4, wait_s=0.5)
                    assert idle.indices == [] and idle.step == 0 and 0.4 <= idle.waited_s <= trio.current_time() - t0
                    answer: list[cm.LeaseReply] = []

                    async def wait_for_tickets() -> None:
                        answer.append(await other.lease(4, wait_s=20.0))

                    async def ask_and_die() -> None:
                        with contextlib.suppress(ProtocolError):
                            await la.lease(4, wait_s=20.0)

                    leases = LeaseCount(coord.core)
                    async with trio.open_nursery() as dying:
                        # The holder asks too (it is over its share now): its held request must not take back the
                        # tickets its own death frees (it did: they went to the dead peer until its expiry).
                        dying.start_soon(ask_and_die)
                        await wait_until(lambda: leases.count == 1, timeout=10.0, what="the holder's lease to be held")
                        nursery.start_soon(wait_for_tickets)
                        # The service asks the core, finds nothing free and parks the request without yielding to trio.
                        await wait_until(lambda: leases.count == 2, timeout=10.0, what="the other lease to be held")
                        dying.cancel_scope.cancel()
                # a's host is closed: like a SIGKILL, its connections drop without a Leave.
                died = trio.current_time()
                await wait_until(lambda: bool(answer), timeout=15.0, what="the held lease's answer")
                took = trio.current_time() - died
                print(f"the held lease was answered {took:.2f} s after the holder died (grace {settings.disconnect_grace_s} s)")
                assert answer[0].indices == held and answer[0].waited_s > 0
                assert took < 10.0  # the 30 s leases did not run out; the margin is for a loaded machine
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_lease_answer_names_the_tickets_the_node_holds_but_did_not_list(open_hosts, run_trio, tmp_path):
    """A lease answer the node never read (it gave the request up as the step changed) left the coordinator counting
    tickets as the node's that the node knew nothing of (bench.py recovery: a 10 s stall after a rejoin). Every
    answer names the tickets the node holds that its request did not list, with their nonces, and a held request
    is answered at once when there are any."""

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, FAST.model_copy(update={"lease_s": 30.0, "expiry_s": 30.0}))
            async with open_hosts(1, introduce=False) as (a,):
                (la,) = coord_links(coord, a)
                assert (await la.join(join_msg(a))).stage == 0
                lost = await la.lease(2)  # the answer the node never read
                assert len(lost.indices) == 2
                t0 = trio.current_time()
                again = await la.lease(2, wait_s=10.0)
                assert again.held == lost.indices and again.held_nonces == lost.nonces
                assert again.waited_s == 0.0 and trio.current_time() - t0 < 5.0
                listed = await la.lease(2, holding=lost.indices + again.indices)
                assert listed.held == []
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_lease_held_at_its_share_is_answered_when_the_replica_finishes_one_and_a_dead_replicas_share_is_freed(open_hosts, run_trio, tmp_path):
    """A replica at its share asks for more (it has room): the coordinator holds the request until the replica's own
    completion (or release) brings it under its share. Waiting only for tickets to free, it waited the whole 2 s,
    once per share, for a step (bench.py recovery, after a kill). And a replica whose connection closed no longer
    counts in the shares: the survivor's share is the whole step from then, not from the dead one's expiry."""
    settings = LONG_LEASES

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await start(nursery, tmp_path, settings)
            async with open_hosts(2, introduce=False) as (b, c):
                lb, lc = coord_links(coord, b, c)
                async with open_hosts(1, introduce=False) as (a,):
                    (la,) = coord_links(coord, a)
                    stages = {}
                    for lk in (la, lb, lc):
                        stages.setdefault((await lk.join(join_msg(lk.host))).stage, []).append(lk)
                    first, second = stages[0]
                    for lk in (first, second):
                        await lk.heartbeat(cm.Heartbeat(state="training", throughput=100.0))
                    lease = await first.lease(4)
                    mine = lease.indices
                    assert len(mine) == 2  # its share: half the step
                    t0 = trio.current_time()
                    async with trio.open_nursery() as asking:
                        got: list[cm.LeaseReply] = []

                        async def ask() -> None:
                            got.append(await first.lease(4, wait_s=10.0, holding=mine))

                        leases = LeaseCount(coord.core)
                        asking.start_soon(ask)
                        await wait_until(lambda: leases.count == 1, timeout=10.0, what="the lease to be held")
                        # It completes one (through the stage-1 member, whose signed ack the completion carries).
                        last = stages[1][0].host
                        route = [first.host.peer_id, last.peer_id]
                        ack = last.sign(ack_statement(default_run().run_hash(), 0, mine[0], route, 2.0, lease.nonces[0]))
                        await first.complete(0, mine[0], route, 2.0, ack, lease.nonces[0])
                    assert got[0].indices and got[0].waited_s < 5.0 and trio.current_time() - t0 < 8.0
                    survivor, dead = (second, first) if first.host is a else (first, second)
                # a's host is closed: like a SIGKILL. If a was the first, its tickets free; either way, once its
                # connection has stayed closed for the grace, the survivor's share is every ticket of the step.
                await wait_until(lambda: not coord.core.registry.present(a.peer_id), timeout=10.0, what="a to be presumed dead")
                assert coord.core.registry.is_live(a.peer_id)  # not expired
                assert coord.core.leases.share(survivor.host.peer_id, coord.core.registry.working_present(0)) == 4
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_host_with_the_coordinators_identity_or_a_members_second_process_is_refused_and_the_member_stays(run_trio, tmp_path):
    """One identity is one process: a real host holding the coordinator's own key, and a second real host
    holding a live member's key (while that member is connected), are refused at join; the member
    keeps heartbeating as before."""
    from protolearn.protocol.identity import Identity, load_or_create_identity
    from protolearn.protocol.transport import open_host

    mine = Identity.generate()

    async def main():
        async with trio.open_nursery() as nursery:
            # A long expiry: a loaded machine must not expire the member, which would hide what this checks.
            coord = await start(nursery, tmp_path, settings=FAST.model_copy(update={"expiry_s": 30.0}))
            async with open_host(mine, ["/ip4/127.0.0.1/tcp/0"]) as member:
                link = CoordinatorLink(member, coord.addrs[0], retry=RETRY)
                joined = await link.join(join_msg(member))
                async with trio.open_nursery() as beats:
                    await beats.start(link.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0))
                    for ident, code in ((load_or_create_identity(tmp_path), "own_identity"), (mine, "identity_in_use")):
                        async with open_host(ident, ["/ip4/127.0.0.1/tcp/0"]) as twin:
                            with pytest.raises(CoordinatorRefused) as err:
                                await CoordinatorLink(twin, coord.addrs[0], retry=RETRY).join(join_msg(twin))
                            assert err.value.code == code, err.value
                    reply = await link.heartbeat(cm.Heartbeat(state="training", throughput=100.0))
                    assert reply.stage == joined.stage and coord.core.registry.is_live(member.peer_id)
                    assert link.rejoins == 0  # it never lost its membership to the twin
                    beats.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


def test_a_step_closes_at_its_quorum_over_the_wire_and_the_parked_long_poll_hears_it(open_hosts, run_trio, tmp_path):
    """A run with ``batch.close_quorum`` (coordinator/core/close_rule.py) on the real service: a stage-0 member
    that leased a ticket and sits on it, alive and heartbeating, does not hold the step. The coordinator's
    housekeeping closes it a grace after the quorum, the parked long poll is answered with accounting that
    leaves the ticket out, the step commits, and the quiet member's late completion is refused."""
    run = default_run().replace(**{"batch.departures": "drop", "batch.close_quorum": 0.75, "batch.close_grace": 0.5})
    B = run.batch.microbatches_per_step
    settings = FAST.model_copy(update={"lease_s": 60.0, "expiry_s": 30.0})

    async def main():
        async with trio.open_nursery() as nursery:
            coord = await nursery.start(lambda task_status: serve(run, tmp_path, settings=settings, task_status=task_status))
            polls = LongPolls(coord.core)
            async with open_hosts(3, introduce=False) as hosts:
                links = coord_links(coord, *hosts)
                replies = [await lk.join(join_msg(lk.host)) for lk in links]
                s0 = [lk for lk, r in zip(links, replies, strict=True) if r.stage == 0]
                s1 = [lk for lk, r in zip(links, replies, strict=True) if r.stage == 1][0]
                quiet, worker = s0
                async with trio.open_nursery() as beats:
                    for lk in links:
                        await beats.start(lk.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0))
                    sat_on = (await quiet.lease(1)).indices
                    assert len(sat_on) == 1
                    waited: list[cm.StepInfo] = []

                    async def waiter() -> None:
                        waited.append(await s1.wait_step(0, timeout_s=20.0))

                    async with trio.open_nursery() as work:
                        parked = polls.count + 1
                        work.start_soon(waiter)
                        await polls.wait_for(parked)
                        done = 0
                        while done < B - 1:
                            lease = await worker.lease(B)
                            for idx, nonce in zip(lease.indices, lease.nonces):
                                route = [worker.host.peer_id, s1.host.peer_id]
                                ack = s1.host.sign(ack_statement(run.run_hash(), lease.step, idx, route, 2.0, nonce))
                                assert not (await worker.complete(lease.step, idx, route, 2.0, ack, nonce)).step_closed
                                done += 1
                        quorum_at = trio.current_time()
                    took = trio.current_time() - quorum_at
                    info = waited[0]
                    acc = {a.stage: {p.peer_id: p.tickets for p in a.peers} for a in info.accounting}
                    assert info.closed and info.revision == 1 and info.num_tickets == B
                    for stage in (0, 1):
                        assert sorted(t for ts in acc[stage].values() for t in ts) == sorted(set(range(B)) - set(sat_on))
                    assert coord.core.ledger.closed[0].dropped == 1
                    print(f"closed {took:.2f} s after the quorum (grace 0.5 x the time to it)")
                    assert (await worker.averaged(0, 1)).committed is False
                    assert (await quiet.averaged(0, 1)).committed is False
                    assert (await s1.averaged(0, 1)).committed
                    idx = sat_on[0]
                    route = [quiet.host.peer_id, s1.host.peer_id]
                    nonce = coord.core.nonce(0, idx)
                    ack = s1.host.sign(ack_statement(run.run_hash(), 0, idx, route, 2.0, nonce))
                    with pytest.raises(CoordinatorRefused, match="closed"):
                        await quiet.complete(0, idx, route, 2.0, ack, nonce)
                    assert (await worker.lease(B)).step == 1  # the swarm goes on
                    beats.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)
