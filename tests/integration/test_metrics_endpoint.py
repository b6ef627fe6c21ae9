"""The coordinator's small metrics endpoint on loopback: GET only, the collector's text, bounded reads."""

from __future__ import annotations

import trio
from protolearn.coordinator.metrics import CONTENT_TYPE, metrics_registry, serve_metrics

from tests.support.metrics import samples, trained_core


async def _request(port: int, raw: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


def test_the_endpoint_answers_get_with_the_text_and_refuses_other_methods() -> None:
    registry = metrics_registry(trained_core(), lambda: 2.0)

    async def main() -> None:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_metrics, registry, 0)
                reply = await _request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                head, _, body = reply.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 OK") and f"Content-Type: {CONTENT_TYPE}".encode() in head
                assert f"Content-Length: {len(body)}".encode() in head
                assert samples(body.decode())[("protolearn_nodes", ())] == 2
                assert (await _request(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
                nursery.cancel_scope.cancel()

    trio.run(main)
