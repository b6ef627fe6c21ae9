"""Real libp2p hosts on 127.0.0.1, started together and introduced to each other."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

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
