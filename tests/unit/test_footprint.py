"""The memory estimate placement relies on (stages/footprint.py): its parameter count is the model's, and sizes
parse with their units. That it is within 30% of a replica's measured peak: tests/integration/test_footprint_peak.py.
"""

from __future__ import annotations


import pytest

from protolearn.node.memory import parse_size
from protolearn.node.worker import StageWorker
from protolearn.stages.config import default_run
from protolearn.stages.footprint import stage_footprint

def test_the_parameter_count_is_the_models() -> None:
    run = default_run()
    for stage in range(run.stages.num_stages):
        assert stage_footprint(run, stage).params == StageWorker(run, stage).numel


def test_sizes_parse_with_their_units_and_refuse_the_rest() -> None:
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size(" 1.5 gb ") == 1_500_000_000
    for bad in ("8", "GB", "eight GB", "8 parsecs", "0GB", "-1GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
