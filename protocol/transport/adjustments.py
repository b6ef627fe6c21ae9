"""What protolearn changes in py-libp2p 0.8's own behaviour, in one place.

- :func:`install` (process-wide, once; every host calls it):
  - a new service task finds its parent by a lookup, not a walk of every task (:mod:`.task_tree`: the walk grew
    with the connections, 8.5 % of a coordinator's CPU at 3,500 members);
  - yamux measures each connection's round trip every 5 minutes, not every 30 s: a ping each way on every
    connection was 330 frames a second at a coordinator of 5,000 members, and the measure only sizes a stream's
    receive window, while a link's round trip does not change faster than that.
- :func:`skip_identify` (per host): the host runs no identify exchange with a peer that connects
  (``TransportConfig.identify_peers`` off: the coordinator reads a member's addresses from its join).
"""

from __future__ import annotations

from typing import Any

from libp2p.abc import IHost
from libp2p.stream_muxer.yamux import yamux

from protolearn.protocol.transport import task_tree

YAMUX_RTT_INTERVAL_S = 300


def install() -> None:
    """Apply the process-wide changes (idempotent)."""
    task_tree.install()
    yamux.RTT_MEASURE_INTERVAL = YAMUX_RTT_INTERVAL_S


def _no_identify(peer_id: Any, *, reason: str) -> None:
    """In place of py-libp2p's identify of a peer that connected."""


def skip_identify(lp: IHost) -> None:
    """``lp`` identifies no peer that connects to it (it still answers a peer's identify of it)."""
    lp._schedule_identify = _no_identify  # type: ignore[attr-defined]
