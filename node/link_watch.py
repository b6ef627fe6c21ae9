"""The coordinator's absence on the node's status line (``coordinator unreachable for N s``), and the
node's metrics endpoint, which reports the same.

While the coordinator is down (restarting, or the network is cut) the node's requests retry in the
background and its status line would otherwise stay frozen at its last step. :func:`watch_link`
reads :attr:`CoordinatorLink.unreachable_since` every second and shows how long it has been, and
clears the note as soon as a request gets through again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from protolearn.node.coordinator_link import CoordinatorLink

WATCH_S = 1.0
# A single failed request is retried within a second: only an absence this long is worth a word.
SHOW_AFTER_S = 2.0


def absence_note(since: float | None, now: float) -> str:
    """The status line's note for an absence that began at ``since`` (None: the coordinator answers)."""
    if since is None or now - since < SHOW_AFTER_S:
        return ""
    return f"coordinator unreachable for {now - since:.0f} s"


async def watch_link(
    link: CoordinatorLink, update: Callable[..., None], *, clock: Callable[[], float] = trio.current_time,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the ``coordinator`` field of the status line (``update(coordinator=...)``) current, until cancelled."""
    task_status.started()
    shown = ""
    while True:
        note = absence_note(link.unreachable_since, clock())
        if note != shown:
            shown = note
            update(coordinator=note)
        await trio.sleep(WATCH_S)


async def serve_node_metrics(config: Any, link: CoordinatorLink, progress: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the node's Prometheus metrics on ``config.metrics_port`` (all interfaces when it listens on all)."""
    from protolearn.metrics_endpoint import serve_metrics
    from protolearn.node.metrics import node_registry

    def unreachable_s() -> float:
        since = link.unreachable_since
        return 0.0 if since is None else max(0.0, trio.current_time() - since)

    host = "0.0.0.0" if config.listen.startswith("/ip4/0.0.0.0/") else "127.0.0.1"
    registry = node_registry(lambda: dict(progress.fields), unreachable_s)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, registry, config.metrics_port, host)
        progress.event("metrics", port=port, host=host)
        task_status.started()
