"""The attacker's identities in this process, for the member attacks: fresh keys that join the swarm target's coordinator.

A :class:`Crew` (``async with Crew(...) as crew``) runs each of its members as one task that opens a host with
a fresh Ed25519 identity, joins, and stays until the crew ends, when it leaves. A member is either plain (it
sends only what the attack sends: :meth:`Crew.member`) or a :class:`~.swarm.Replica` that otherwise behaves as
an honest replica does, with its :class:`~.swarm.Lies` (it reports its step results, so the coordinator's
commit never waits on it: :meth:`Crew.replica`). Placement is the coordinator's (a joiner cannot pick its
stage), so an attack that needs a member in one stage joins fresh identities until one lands there
(:meth:`Crew.land_in`), as an attacker would; the others stay as idle replicas. When the crew ends every member
leaves, so the next attack starts from the honest swarm again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from protolearn.errors import ProtolearnError
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.identity import Identity
from protolearn.protocol.states import NodeState
from protolearn.protocol.transport import open_host

from abuse_bench.harness import split_addr
from abuse_bench.swarm import HONEST, Lies, Replica

log = logging.getLogger("protolearn.bench")
LEAVE_S = 5.0


class Member:
    """A plain member: its host and join reply; :meth:`leave` ends it (it leaves the swarm) before the crew does."""

    def __init__(self, host: Any, reply: cm.JoinReply) -> None:
        self.host = host
        self.reply = reply
        self.scope = trio.CancelScope()
        self.left = trio.Event()

    @property
    def me(self) -> str:
        return self.host.peer_id

    async def leave(self) -> None:
        self.scope.cancel()
        await self.left.wait()


class Crew:
    def __init__(self, coordinator: str, run: Any, numel: int) -> None:
        self.coordinator = coordinator
        self.coord_base, self.coord_id = split_addr(coordinator)
        self.run = run
        self.numel = numel
        self.replicas: list[Replica] = []
        self.plain: list[Member] = []
        self._nursery_cm = trio.open_nursery()
        self._nursery: trio.Nursery | None = None

    async def __aenter__(self) -> Crew:
        self._nursery = await self._nursery_cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        return await self._nursery_cm.__aexit__(*exc)

    async def _run(self, make: Callable[[Any], Awaitable[Any]], stay: Callable[[Any], Awaitable[None]], *,
                   task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with open_host(Identity.generate()) as host:
            host.add_peer_addrs(self.coord_id, [self.coord_base])
            made = await make(host)
            task_status.started(made)
            try:
                with made.scope if isinstance(made, Member) else trio.CancelScope():
                    await stay(made)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_S):
                    try:
                        await host.request(self.coord_id, cm.COORDINATOR, cm.Leave(reason="bench: attack over"), cm.LeaveReply, timeout=LEAVE_S)
                    except ProtocolError as err:
                        log.info("crew member %s did not leave: %s", host.peer_id, err.reason)
                if isinstance(made, Member):
                    made.left.set()

    async def replica(self, name: str, *, lies: Lies = HONEST, state: NodeState | None = None, leases: bool = False) -> Replica:
        """A fresh identity joined as a replica that serves (``leases``: a stage-0 one leases tickets too)."""
        assert self._nursery is not None

        async def make(host: Any) -> Replica:
            r = Replica(host, self.coordinator, self.run, name=name, numel=self.numel, lies=lies, state=state)
            r.allow_leases(None if leases else -1)
            await r.join()
            return r

        async def stay(r: Replica) -> None:
            try:
                await r.serve()
            except* ProtolearnError as group:  # an attacker that the coordinator stopped: it stays connected
                log.info("crew replica %s stopped: %s", name, group.exceptions[0])
            await trio.sleep_forever()  # banned: it stays connected, as a banned node that keeps trying would

        r = await self._nursery.start(self._run, make, stay)
        self.replicas.append(r)
        return r

    async def land_in(self, stage: int, name: str, *, lies: Lies = HONEST, leases: bool = False, tries: int = 16) -> Replica:
        """Join fresh identities until one lands in ``stage``; those placed elsewhere stay as idle replicas."""
        for k in range(tries):
            r = await self.replica(f"{name}-{k}", lies=lies, leases=leases)
            if r.stage == stage:
                return r
        raise RuntimeError(f"no identity of {tries} landed in stage {stage}")

    async def member(self, name: str, *, throughput: float = 100.0, state: NodeState | None = None) -> Member:
        """A fresh identity joined as a plain member; with ``state`` it heartbeats that state every interval (else it
        expires after ``expiry_s``)."""
        assert self._nursery is not None

        async def make(host: Any) -> Member:
            addrs = [a.rsplit("/p2p/", 1)[0] for a in host.addrs()]
            join = cm.Join(addrs=addrs, throughput=throughput, name=name)
            return Member(host, await host.request(self.coord_id, cm.COORDINATOR, join, cm.JoinReply, timeout=30))

        async def stay(m: Member) -> None:
            while state is not None:
                try:
                    await m.host.request(self.coord_id, cm.COORDINATOR, cm.Heartbeat(state=state.value, throughput=throughput),
                                         cm.HeartbeatReply, timeout=10)
                except ProtocolError as err:
                    log.info("crew member %s heartbeat failed: %s", name, err.reason)
                await trio.sleep(m.reply.heartbeat_interval_s)
            await trio.sleep_forever()

        m = await self._nursery.start(self._run, make, stay)
        self.plain.append(m)
        return m


async def seen(target: Any, peers: list[str], timeout: float = 30.0) -> None:
    """Wait until every honest replica of ``target`` (:mod:`.swarm_target`) has ``peers`` in its view as live replicas."""
    with trio.fail_after(timeout):
        while not (await target.ask("sees", peers=peers))["ok"]:
            await trio.sleep(0.1)
