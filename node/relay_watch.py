"""How this node's peers reach it, as its heartbeats say, and what it does when its relay goes away.

A node's :class:`~protolearn.node.reachability.Reachability` comes from the check at join time.
:class:`RelayWatch` keeps it for the node's life: the heartbeat's ``path`` (how the peers it exchanges
tensors with reach it now: directly, or through its relay until hole punching upgraded their link,
:func:`~protolearn.node.reachability.heartbeat_path`), logged once per change with each peer's link, and
the addresses a heartbeat carries once they changed since the join.

A node behind a NAT is reachable only through its relay. When it has had no connection to that relay
for RELAY_LOST_CHECKS checks in a row (the relay left or died, and the transport's renewals failed),
:meth:`RelayWatch.watch` moves it: first to a relay it already knows, else to one the coordinator
offers anew. From then on its heartbeats carry the new address, which the coordinator puts in the view
for its peers. A check that finds no other relay changes nothing and is tried again later.
"""

from __future__ import annotations

import logging

import trio
from protolearn.node.config import NodeConfig
from protolearn.node.errors import JoinError
from protolearn.node.progress import Progress
from protolearn.node.reachability import RELAY_CHECK_S, RELAY_LOST_CHECKS, Reachability, establish, heartbeat_path, move_relay, relay_peer
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")


class RelayWatch:
    """This node's reachability over its life (see the module docstring)."""

    def __init__(self, host: Host, config: NodeConfig, progress: Progress, reachability: Reachability, *, coordinator: str) -> None:
        self.host = host
        self.config = config
        self.progress = progress
        self.reachability = reachability
        self.coordinator = coordinator
        self._last_path = ""  # the last path reported, to log each change once
        self._moved = False  # its addresses changed since it joined (it moved to another relay)

    def path(self, neighbours: list[str]) -> str:
        """How this node's stage peers reach it now; ``neighbours``: the peers it exchanges tensors with
        (the live members of the adjacent stages). A change is logged with each of their links."""
        verdict = self.reachability.verdict
        path = heartbeat_path(verdict, self.host, neighbours if verdict == "private" else [])
        if path != self._last_path:
            self._last_path = path
            self.progress.event("path", path=path, peers={p: self.host.path_to(p) for p in neighbours})
        return path

    def addrs(self) -> list[str]:
        """The addresses a heartbeat carries: the current ones once they changed since the join, else none."""
        return list(self.reachability.addrs) if self._moved else []

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Move to another relay when this node's is gone (see the module docstring); runs until cancelled."""
        task_status.started()
        misses = 0
        while True:
            await trio.sleep(RELAY_CHECK_S)
            reach = self.reachability
            if reach.verdict != "private" or not reach.relay or self.host.path_to(relay_peer(reach.relay)) is not None:
                misses = 0
                continue
            misses += 1
            if misses < RELAY_LOST_CHECKS:
                continue
            misses = 0
            self.progress.say(f"lost the relay {relay_peer(reach.relay)[-8:]}; looking for another")
            # The relays it already knows first; only when none has a slot, ask the coordinator for new offers.
            found = await move_relay(self.host, self.config, reach, say=self.progress.say)
            if found is None:
                try:
                    found = await establish(self.host, self.coordinator, self.config, say=self.progress.say, avoid=reach.relay)
                except JoinError as err:
                    found = Reachability("unknown", str(err), [])
            if found.verdict == "unknown":
                # No answer (the check failed, or no relay had a slot): it is no less private than
                # before, so it keeps its address and tries again at the next round.
                log.warning("no other relay yet: %s", found.reason)
                self.progress.event("relay_lost", relay=reach.relay, reason=found.reason)
                continue
            self.host.relay.forget(relay_peer(reach.relay))
            self.reachability = found
            self._moved = True
            self.progress.event("relay_changed", old=reach.relay, relay=found.relay, verdict=found.verdict, addrs=found.addrs)
