"""Coordinator metrics: the collector's families as a Prometheus server parses them (the HTTP endpoint:
tests/integration/test_metrics_endpoint.py)."""

from __future__ import annotations

import pytest
from protolearn.coordinator.metrics import exposition, metrics_registry

from tests.support.coordinator import default_core as make_core
from tests.support.metrics import samples, trained_core


def test_the_collector_reports_the_core_as_a_prometheus_server_reads_it() -> None:
    core = trained_core()
    text = exposition(metrics_registry(core, lambda: 2.0)).decode()
    got = samples(text)
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
        got = samples(exposition(registry).decode())
        assert ("protolearn_loss", ()) not in got and got[("protolearn_last_closed_step", ())] == -1


def test_each_family_is_written_once_and_the_process_metrics_come_with_it() -> None:
    text = exposition(metrics_registry(trained_core(), lambda: 2.0)).decode()
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)
    assert samples(text)[("protolearn_bans", ())] == 0
    assert "process_resident_memory_bytes" in families and "process_cpu_seconds" in " ".join(families)


def test_a_node_reports_its_status_line_as_metrics() -> None:
    from protolearn.node.metrics import node_registry

    fields = {"stage": 1, "step": 7, "steps": 40, "state": "training", "loss": 2.5, "tokens_per_s": 900.0, "peers": 3, "in_flight": 2}
    got = samples(exposition(node_registry(lambda: fields, lambda: 12.0)).decode())
    assert got[("protolearn_node_step", ())] == 7 and got[("protolearn_node_run_steps", ())] == 40
    assert got[("protolearn_node_stage", ())] == 1 and got[("protolearn_node_loss", ())] == 2.5
    assert got[("protolearn_node_coordinator_unreachable_seconds", ())] == 12.0
    assert got[("protolearn_node_state", (("state", "training"),))] == 1 and got[("protolearn_node_state", (("state", "syncing"),))] == 0
