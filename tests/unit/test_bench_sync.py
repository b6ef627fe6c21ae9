"""The sync bench resumes: a run finished by an earlier call with the same settings and package is kept, any other is made again.

The bench's runs are real local swarms of about half an hour each; here the swarm itself is replaced by a
function that records that it was asked to train (a fake: the point is which runs the bench trains again,
not the training, which ``tests/e2e/test_diloco.py`` and the CI's swarm tests cover).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_script



@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = load_script("bench_sync")
    trained: list[Path] = []

    class Internet:
        @staticmethod
        def swarm_run(workdir: Path, **_: Any) -> dict[str, Any]:
            trained.append(workdir)
            return {"tokens_per_s": 100.0, "s_per_step": 1.0, "tokens_per_step": 10, "final_loss": 3.0, "losses": [3.0],
                    "nodes_failed": {}, "wall_s": 1.0, "breakdown": {}}

    monkeypatch.setattr(module, "_internet", lambda: Internet)
    monkeypatch.setattr(module, "sync_bytes", lambda workdir, tokens_per_step: (2.0, [20.0]))
    monkeypatch.setattr(module, "final_val_loss", lambda workdir: (8, 2.5))
    module.trained = trained
    yield module
    sys.modules.pop(module.__name__, None)


def test_a_finished_run_is_kept_only_for_the_same_settings_and_package(bench: Any, tmp_path: Path) -> None:
    common = {"link": "50mbit,40ms", "steps": 6, "warmup": 2, "nodes": 4}
    first = bench.one_run(tmp_path / "r", "diloco32-int8", 0, tree="abc", **common)
    assert first["reused"] is False and len(bench.trained) == 1
    assert json.loads((tmp_path / "r" / "result.json").read_text())["key"]["package_tree"] == "abc"

    again = bench.one_run(tmp_path / "r", "diloco32-int8", 0, tree="abc", **common)
    assert again["reused"] is True and len(bench.trained) == 1
    assert again["final_val_loss"] == first["final_val_loss"] and again["started"] == first["started"]

    # Another package, another seed, other steps, or no package hash at all (uncommitted changes): trained again.
    for change in ({"tree": "abd"}, {"tree": "abc", "seed": 1}, {"tree": "abc", "steps": 7}, {"tree": None}):
        kwargs = {**common, "tree": "abc", "seed": 0, **change}
        seed = kwargs.pop("seed")
        before = len(bench.trained)
        r = bench.one_run(tmp_path / "r", "diloco32-int8", seed, **kwargs)
        assert r["reused"] is False and len(bench.trained) == before + 1, change


def test_a_run_left_unfinished_is_cleared_and_made_again(bench: Any, tmp_path: Path) -> None:
    run = tmp_path / "r"
    (run / "node0").mkdir(parents=True)
    (run / "node0" / "node.jsonl").write_text("{}\n")
    (run / "result.json").write_text("{not json")
    r = bench.one_run(run, "none", 0, link=None, steps=6, warmup=2, nodes=4, tree="abc")
    assert r["reused"] is False and bench.trained == [run]
    assert not (run / "node0").exists()


def test_internet_efficiency_pairs_each_seed_with_its_own_loopback_run(bench: Any) -> None:
    loop = [{"seed": 0, "tokens_per_s": 100.0}, {"seed": 1, "tokens_per_s": 50.0}]
    link = [{"seed": 0, "tokens_per_s": 80.0}, {"seed": 1, "tokens_per_s": 30.0}]
    # (0.8 + 0.6) / 2, not the ratio of the means (55 / 75).
    assert bench.efficiency(link, loop) == pytest.approx(0.7)


def test_a_replicas_sync_bytes_count_its_outer_rounds_as_well_as_its_steps(tmp_path: Path) -> None:
    """DiLoCo replicas send nothing per step; their outer rounds' bytes are in ``outer_sync`` events. Counting only
    ``step`` events gave a DiLoCo run 0 bytes per token (the first full run of the bench, 2026-12-06)."""
    module = load_script("bench_sync")
    for node, extra in (("node0", 0), ("node1", 100)):
        (tmp_path / node).mkdir()
        lines = [{"event": "step", "step": t, "sync_bytes": 0} for t in range(4)]
        lines.insert(2, {"event": "outer_sync", "step": 1, "round": 1, "sync_bytes": 1000 + extra})
        lines.append({"event": "outer_sync", "step": 3, "round": 2, "sync_bytes": 3000 + extra})
        (tmp_path / node / "node.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines) + "not json\n")
    per_token, cumulative = module.sync_bytes(tmp_path, tokens_per_step=10)
    assert per_token == pytest.approx(((4000 + 4200) / 2) / 40)
    assert cumulative == pytest.approx([0.0, 1050.0, 1050.0, 4100.0])
