"""Coordinator metrics: the collector's families as a Prometheus server parses them, and the small
HTTP endpoint (GET only, bounded reads) on loopback."""

from __future__ import annotations

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.metrics import CONTENT_TYPE, exposition, metrics_registry, serve_metrics

from tests.unit.test_coord_core import join, make_core, run_step


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _trained_core() -> CoordinatorCore:
    core = make_core()
    join(core, "a")
    join(core, "b")
    with pytest.raises(Refusal):
        join(core, "a")  # counted as an already_joined refusal
    run_step(core, "a", "b", 1.0)
    return core


def test_the_collector_reports_the_core_as_a_prometheus_server_reads_it() -> None:
    core = _trained_core()
    text = exposition(metrics_registry(core, lambda: 2.0)).decode()
    got = _samples(text)
    assert got[("protolearn_up", ())] == 1
    assert got[("protolearn_nodes", ())] == 2
    assert got[("protolearn_stage_replicas", (("stage", "0"),))] == 1
    assert got[("protolearn_stage_replicas", (("stage", "1"),))] == 1
    assert got[("protolearn_step", ())] == 1 and got[("protolearn_last_closed_step", ())] == 0
    assert got[("protolearn_loss", ())] == pytest.approx(core.ledger.closed[0].loss)
    assert got[("protolearn_refusals_total", (("code", "already_joined"),))] == core.admission.refusals["already_joined"] >= 1
    assert got[("protolearn_tickets_reissued_total", ())] == 0
    # the classic text format: counters are typed under their _total name
    assert "# TYPE protolearn_refusals_total counter\n" in text and "# TYPE protolearn_step gauge\n" in text


def test_a_fresh_core_has_no_loss_and_registries_do_not_collide() -> None:
    a, b = metrics_registry(make_core(), lambda: 0.0), metrics_registry(make_core(), lambda: 0.0)
    for registry in (a, b):
        got = _samples(exposition(registry).decode())
        assert ("protolearn_loss", ()) not in got and got[("protolearn_last_closed_step", ())] == -1


async def _request(port: int, raw: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


def test_the_endpoint_answers_get_with_the_text_and_refuses_other_methods() -> None:
    registry = metrics_registry(_trained_core(), lambda: 2.0)

    async def main() -> None:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_metrics, registry, 0)
                reply = await _request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                head, _, body = reply.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 OK") and f"Content-Type: {CONTENT_TYPE}".encode() in head
                assert f"Content-Length: {len(body)}".encode() in head
                assert _samples(body.decode())[("protolearn_nodes", ())] == 2
                assert (await _request(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
                nursery.cancel_scope.cancel()

    trio.run(main)
