"""Prometheus text metrics of the coordinator, and the tiny trio HTTP server that serves them.

:func:`render` is pure: it reads the core at ``now`` and returns exposition-format text (nodes per
stage, step, tokens/s, loss, bans, refusals by code, re-issued tickets, health). :func:`serve_metrics`
answers every ``GET`` on the port with that text. It reads at most :data:`MAX_REQUEST_BYTES` of the
request within :data:`READ_TIMEOUT_S`, so a slow or hostile scraper cannot hold memory or a task for
long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from protolearn.coordinator.status import build_status

if TYPE_CHECKING:
    from protolearn.coordinator.core import CoordinatorCore

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16

log = logging.getLogger("protolearn.coordinator")


def render(core: CoordinatorCore, now: float) -> str:
    st = build_status(core, now, history_len=1)
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP protolearn_{name} {help_}")
        lines.append(f"# TYPE protolearn_{name} {kind}")
        for labels, value in samples:
            lines.append(f"protolearn_{name}{labels} {float(value):.10g}")

    metric("up", "gauge", "1 while the coordinator serves.", [("", 1)])
    metric("nodes", "gauge", "Live members.", [("", len(st.nodes))])
    metric("stage_replicas", "gauge", "Live replicas per stage.", [(f'{{stage="{s.index}"}}', s.replicas) for s in st.stages])
    metric(
        "stage_throughput", "gauge", "Summed member throughput per stage (layer-tokens/s).",
        [(f'{{stage="{s.index}"}}', s.throughput) for s in st.stages],
    )
    metric("step", "gauge", "The open step.", [("", st.step)])
    metric("last_closed_step", "gauge", "The last closed step (-1: none).", [("", st.last_closed)])
    metric("tokens_per_second", "gauge", "Training tokens per second over recent steps.", [("", st.tokens_per_s)])
    if st.loss is not None:
        metric("loss", "gauge", "Mean loss of the last closed step.", [("", st.loss)])
    metric("bans", "gauge", "Banned peers.", [("", len(st.bans))])
    metric("healthy", "gauge", "1 when the verdict is healthy.", [("", 1 if st.healthy else 0)])
    metric("halted", "gauge", "1 when training is halted.", [("", 1 if st.verdict == "halted" else 0)])
    metric(
        "refusals_total", "counter", "Refused requests by code.",
        [(f'{{code="{code}"}}', n) for code, n in sorted(core.refusals.items())],
    )
    metric("tickets_reissued_total", "counter", "Expired leases re-issued.", [("", core.reissued)])
    return "\n".join(lines) + "\n"


async def serve_metrics(
    text: Callable[[], str],
    port: int,
    host: str = "127.0.0.1",
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``text()`` over HTTP on ``host:port`` (0 picks a free port) until cancelled.

    ``task_status.started`` receives the bound port.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handle(stream: trio.SocketStream) -> None:
        async with limiter, stream:
            try:
                await _answer(stream, text)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as err:
                log.info("metrics client went away: %s", err)

    log.info("metrics on http://%s:%d/metrics", host, bound)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound)


async def _answer(stream: trio.SocketStream, text: Callable[[], str]) -> None:
    request = b""
    with trio.move_on_after(READ_TIMEOUT_S):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            chunk = await stream.receive_some(MAX_REQUEST_BYTES - len(request))
            if not chunk:
                break
            request += chunk
    if request.startswith(b"GET "):
        body = text().encode()
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
    else:
        body = b"only GET is served\n"
        head = f"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with trio.move_on_after(READ_TIMEOUT_S):
        await stream.send_all(head.encode() + body)
