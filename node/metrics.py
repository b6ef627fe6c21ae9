"""Prometheus metrics of a node (``node join --metrics-port``): what its status line shows, for a scraper.

:class:`NodeCollector` reads the node's :class:`~protolearn.node.progress.Progress` fields (stage,
step, tokens/s, loss, peers, microbatches in flight, state) and how long the coordinator has been
unreachable, on each scrape, and holds no state of its own; :func:`node_registry` adds the process's
``process_*`` metrics. :func:`protolearn.metrics_endpoint.serve_metrics` serves the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protolearn.protocol.states import NodeState

PREFIX = "protolearn_node_"


class NodeCollector(Collector):
    """``fields()`` are the status line's fields; ``unreachable_s()`` the coordinator's absence (0: it answers)."""

    def __init__(self, fields: Callable[[], dict[str, Any]], unreachable_s: Callable[[], float]) -> None:
        self.fields = fields
        self.unreachable_s = unreachable_s

    def collect(self) -> Iterator[Metric]:
        f = self.fields()

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, help_, value=value)

        yield gauge("up", "1 while the node runs.", 1)
        if isinstance(f.get("stage"), int):
            yield gauge("stage", "The stage this node serves.", f["stage"])
        yield gauge("step", "Steps this node's stage has applied.", f.get("step", 0))
        yield gauge("run_steps", "The steps this node trains (the run's, or --max-steps).", f.get("steps", 0))
        yield gauge("tokens_per_second", "Tokens per second this node processed since it started.", f.get("tokens_per_s", 0.0))
        if f.get("loss") is not None:
            yield gauge("loss", "Mean loss of the last applied step (last stage only).", f["loss"])
        yield gauge("peers", "Other members in this node's view.", f.get("peers", 0))
        yield gauge("in_flight", "Microbatches holding activations now.", f.get("in_flight", 0))
        yield gauge("coordinator_unreachable_seconds", "How long the coordinator has not answered (0: it answers).", self.unreachable_s())
        state = GaugeMetricFamily(PREFIX + "state", "1 for the state the node is in.", labels=["state"])
        for s in [*(s.value for s in NodeState), "joining"]:
            state.add_metric([s], 1 if f.get("state") == s else 0)
        yield state


def node_registry(fields: Callable[[], dict[str, Any]], unreachable_s: Callable[[], float]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(fields, unreachable_s))
    ProcessCollector(registry=registry)
    return registry
