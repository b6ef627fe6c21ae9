"""Real libp2p hosts on 127.0.0.1, started together and introduced to each other."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import Host, TransportConfig, open_host


@asynccontextmanager
async def open_mesh(identities: Sequence[Identity], config: TransportConfig, *, introduce: bool = True) -> AsyncIterator[list[Host]]:
    """One started host per identity; with ``introduce`` each knows the others' addresses (dials by peer ID
    work); leaving the block closes them all."""
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(i, config=config)) for i in identities]
        if introduce:
            for h in hosts:
                for other in hosts:
                    if other is not h:
                        h.add_peer_addrs(other.peer_id, other.addrs())
        yield hosts


@asynccontextmanager
async def open_member(identity: Identity, config: TransportConfig, addrs: dict[str, list[str]], all_up: trio.Event,
                      task_status: trio.TaskStatus[None]) -> AsyncIterator[Host]:
    """One host of a group whose members each run in a task of their own (so a test can kill one): it adds its
    addresses to ``addrs``, says it started, waits for ``all_up`` (every member's addresses are in), and knows the
    others' addresses before the body runs."""
    async with open_host(identity, config=config) as host:
        addrs[identity.peer_id] = host.addrs()
        task_status.started()
        await all_up.wait()
        for other, a in addrs.items():
            if other != identity.peer_id:
                host.add_peer_addrs(other, a)
        yield host
