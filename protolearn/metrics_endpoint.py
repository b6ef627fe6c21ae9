"""A tiny Prometheus endpoint on trio: ``GET`` answers with a registry's text, anything else with 405.

It reads at most :data:`MAX_REQUEST_BYTES` of a request within :data:`READ_TIMEOUT_S` and serves at most
:data:`MAX_CONNECTIONS` clients at once, so a slow or hostile scraper cannot hold memory or a task for
long; it runs in the caller's nursery, so it stops with it (see :mod:`protolearn.coordinator.metrics`
for why not prometheus_client's own server). A port that cannot be bound is one
:class:`~protolearn.errors.ConfigError` line naming it, not a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest

from protolearn.errors import ConfigError

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16
# The classic text format, which every Prometheus server reads (the library's LATEST says version=1.0.0).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger("protolearn.metrics")


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format (version 0.0.4, :data:`CONTENT_TYPE`)."""
    return generate_latest(registry)


async def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` over HTTP on ``host:port`` (0 picks a free port) until cancelled.

    ``task_status.started`` receives the bound port.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as err:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port}: {err.strerror or err}; pick a free port (0 picks one)") from None
    bound = listeners[0].socket.getsockname()[1]
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handle(stream: trio.SocketStream) -> None:
        async with limiter, stream:
            try:
                await _answer(stream, registry)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as err:
                log.info("metrics client went away: %s", err)

    log.info("metrics on http://%s:%d/metrics", host, bound)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound)


async def _answer(stream: trio.SocketStream, registry: CollectorRegistry) -> None:
    request = b""
    with trio.move_on_after(READ_TIMEOUT_S):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            chunk = await stream.receive_some(MAX_REQUEST_BYTES - len(request))
            if not chunk:
                break
            request += chunk
    if request.startswith(b"GET "):
        body = exposition(registry)
        head = f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    else:
        body = b"only GET is served\n"
        head = f"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with trio.move_on_after(READ_TIMEOUT_S):
        await stream.send_all(head.encode() + body)
