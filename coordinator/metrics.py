"""Prometheus metrics of the coordinator: a collector over the core, and the small trio HTTP endpoint.

:class:`CoordinatorCollector` is a prometheus_client custom collector: on every scrape it reads the
core at ``clock()`` and yields metric families (nodes per stage, step, tokens/s, loss, bans, refusals
by code, re-issued tickets, health). :func:`metrics_registry` puts it in a registry of its own (not
the process-global ``REGISTRY``, so two coordinators in one process do not collide), and
:func:`exposition` writes that registry with prometheus_client's ``generate_latest``: escaping, number
formatting and the ``HELP``/``TYPE`` lines are the library's.

:func:`serve_metrics` answers every ``GET`` on the port with that text, with the process's own
``process_*`` metrics (CPU, memory, open files) beside the coordinator's. It reads at most
:data:`MAX_REQUEST_BYTES` of the request within :data:`READ_TIMEOUT_S` and serves at most
:data:`MAX_CONNECTIONS` clients at once, so a slow or hostile scraper cannot hold memory or a task
for long.

The HTTP endpoint is :mod:`protolearn.metrics_endpoint` (nodes serve theirs with it too). Why it is our own (about 40 lines of trio) rather than prometheus_client's
``start_http_server``. Measured with prometheus_client 0.26: that server starts one OS thread per
connection, with no read deadline and no cap, so 200 clients that send half a request head held 200
threads for as long as they stayed (still 200 after 10 s; back to 2 only when they hung up), where
this one holds 16 handlers and drops each after 5 s (I4, I5). It also runs in a daemon thread outside
the coordinator's nursery, so it would not stop when the coordinator is cancelled, and its collector
would read the core from that thread while the trio thread changes it; here a scrape runs on the trio
thread between two coordinator events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.status import build_status
from protolearn.metrics_endpoint import CONTENT_TYPE, exposition, serve_metrics

__all__ = ["CONTENT_TYPE", "CoordinatorCollector", "exposition", "metrics_registry", "serve_metrics"]

PREFIX = "protolearn_"


class CoordinatorCollector(Collector):
    """Reads the coordinator core at ``clock()`` on each scrape; holds no state of its own."""

    def __init__(self, core: CoordinatorCore, clock: Callable[[], float]) -> None:
        self.core = core
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        core = self.core
        st = build_status(core, self.clock(), history_len=1)

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, help_, value=value)

        def per_stage(name: str, help_: str, values: list[tuple[int, float]]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, help_, labels=["stage"])
            for index, value in values:
                family.add_metric([str(index)], value)
            return family

        yield gauge("up", "1 while the coordinator serves.", 1)
        yield gauge("nodes", "Live members.", len(st.nodes))
        yield per_stage("stage_replicas", "Live replicas per stage.", [(s.index, s.replicas) for s in st.stages])
        yield per_stage(
            "stage_throughput", "Summed member throughput per stage (layer-tokens/s).",
            [(s.index, s.throughput) for s in st.stages],
        )
        yield gauge("step", "The open step.", st.step)
        yield gauge("last_closed_step", "The last closed step (-1: none).", st.last_closed)
        yield gauge("tokens_per_second", "Training tokens per second over recent steps.", st.tokens_per_s)
        if st.loss is not None:
            yield gauge("loss", "Mean loss of the last closed step.", st.loss)
        yield gauge("bans", "Banned peers.", len(st.bans))
        yield gauge("healthy", "1 when the verdict is healthy.", 1 if st.healthy else 0)
        yield gauge("halted", "1 when training is halted.", 1 if st.verdict == "halted" else 0)
        # Counter families are named without "_total"; the writer adds it to the sample and TYPE lines.
        refusals = CounterMetricFamily(PREFIX + "refusals", "Refused requests by code.", labels=["code"])
        for code, n in sorted(core.admission.refusals.items()):
            refusals.add_metric([code], n)
        yield refusals
        yield CounterMetricFamily(PREFIX + "tickets_reissued", "Expired leases re-issued.", value=core.reissued)
        desk = core.integrity
        yield CounterMetricFamily(PREFIX + "integrity_reports", "Integrity reports that reached a verdict (ban or flag).", value=sum(desk.against.values()))
        passed = sum(c.passed for by in desk.checks.values() for c in by.values())
        failed = sum(c.failed for by in desk.checks.values() for c in by.values())
        checks = GaugeMetricFamily(PREFIX + "spot_checks", "Spot checks of live members as their checkers last reported them.", labels=["result"])
        checks.add_metric(["passed"], passed)
        checks.add_metric(["failed"], failed)
        yield checks


def metrics_registry(core: CoordinatorCore, clock: Callable[[], float]) -> CollectorRegistry:
    """A registry of its own holding the coordinator's collector and this process's ``process_*`` metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(core, clock))
    ProcessCollector(registry=registry)
    return registry
