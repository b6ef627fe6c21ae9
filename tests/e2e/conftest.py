"""Fixtures of the end-to-end tests, and which of them need the machine to themselves.

Most end-to-end tests start a swarm that uses both cores and time what it does (a ban within so many
microbatches, a step time within 3 x an honest run's): ``scripts/test.sh`` runs those one at a time
(marker ``solo``, added here to every test of this folder). The modules in :data:`SHARE_THE_MACHINE` assert
nothing that depends on speed (CLI errors, exports, one node's join, benchmark reports, a single-process
trainer, a swarm's export and checkpoint restore, placement by memory, the coordinator's restarts and load, a
first day's mistakes, the NAT topology's rules), so ``scripts/test.sh`` runs them beside the unit and
integration tests on two workers instead. (A swarm here used 1.2 of the two cores on average when run alone,
and passes beside a 1,000-node simulation that keeps both busy.) test_swarm and test_sync_compression stay
solo although they time nothing: they need two replicas per stage, and placement follows the throughput the
first nodes measured, which a loaded machine skews (beside other tests, 3 of 4 nodes once went to one stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.swarm import TINY, Swarm

SHARE_THE_MACHINE = frozenset({
    "test_addresses.py", "test_bench_report.py", "test_checkpoint_restore.py", "test_cli_errors.py", "test_coord_bench.py",
    "test_coordinator_cli.py", "test_coordinator_load.py", "test_coordinator_wait.py", "test_corpus_check.py", "test_export.py",
    "test_first_day.py", "test_memory.py", "test_netns_topology.py", "test_node_leave.py", "test_stages_bench.py",
    "test_swarm_export.py", "test_train_local.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        if path.parent == here and path.name not in SHARE_THE_MACHINE:
            item.add_marker(pytest.mark.solo)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Callable[..., Swarm]]:
    """``swarm(steps=..., codec=..., layers=..., stages=...)``: a :class:`Swarm` on a :data:`TINY` run config;
    every process it started is stopped when the test ends."""
    made: list[Swarm] = []

    def make(**fmt: object) -> Swarm:
        config = tmp_path / "run.toml"
        config.write_text(TINY.format(**fmt))
        s = Swarm(tmp_path, config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
