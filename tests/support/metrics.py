"""The coordinator's metrics as a Prometheus server reads them, from a core that saw a little of everything."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.errors import Refusal

from tests.support.coordinator import default_core, join, run_step


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def trained_core() -> CoordinatorCore:
    core = default_core()
    join(core, "a")
    join(core, "b")
    with pytest.raises(Refusal):
        join(core, "a")  # counted as an already_joined refusal
    run_step(core, "a", "b", 1.0)
    return core
