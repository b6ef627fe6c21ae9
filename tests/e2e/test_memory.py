"""Placement respects memory, as real processes (issue 25; stages/footprint.py, coordinator/core/fit.py).

On test_swarm's tiny two-stage run (footprints at ``--max-in-flight 8``: stage 0 about 9.0 MB, the last
stage 5.6 MB), a node whose ``--max-memory`` holds no stage stops with one line that says what it has and
what the smallest stage needs; a node that holds only the last stage is placed there, although placement
by throughput would give the first joiner the empty stage 0; an unconstrained node then takes stage 0 and
the run trains to its end. How close the estimate is to a replica's real peak: tests/unit/test_footprint.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from protolearn.stages.config import RunConfig
from protolearn.stages.footprint import stage_footprints
from tests.support.cli import join_node, the_error_line
from tests.support.swarm import TINY, Swarm

STEPS = 3


def test_a_node_goes_only_where_its_memory_holds_the_stage(tmp_path: Path) -> None:
    text = TINY.format(steps=STEPS, codec="none", layers=4, stages=2)
    first, last = (f.total(8) for f in stage_footprints(RunConfig.from_toml_text(text)))
    assert last < first
    config = tmp_path / "run.toml"
    config.write_text(text)
    s = Swarm(tmp_path, config)
    try:
        addr = s.start_coordinator()
        small = join_node(addr, tmp_path / "small", "--name", "small", "--max-memory", f"{last * 0.8 / 1e6:.2f}MB")
        line = the_error_line(small)
        assert small.returncode == 1 and "offers" in line and f"needs {last / 1e9:.3g} GB" in line, line
        s.start_node("fits", addr, "--max-memory", f"{(first + last) / 2e6:.2f}MB")
        deadline = time.monotonic() + 120  # it joins first, to an empty swarm (it builds once stage 0 has a replica)
        while not (tmp_path / "fits" / "node.jsonl").exists() or not s.events("fits", "joined"):
            assert time.monotonic() < deadline and s.procs["fits"].poll() is None, s.err("fits")
            time.sleep(0.2)
        s.start_node("big", addr)
        s.wait_nodes(["fits", "big"], timeout=240)
        assert s.events("fits", "joined")[0]["stage"] == 1, s.events("fits", "joined")
        assert [b["stage"] for b in s.events("fits", "built")] == [1], s.err("fits")
        assert [b["stage"] for b in s.events("big", "built")] == [0], s.err("big")
    finally:
        s.stop()
