"""A swarm with one node on a slow emulated link (``demo --links``): the link changes time, not values.

Two demo runs of the same tiny run, one plain and one with node 0 shaped to 8 Mbit/s: the losses must be
identical step by step (the link reorders nothing and drops nothing), and node 0's own record of its
link (the ``link`` event: the transport's byte counters next to the link model's clock) must show that
every byte it sent or received passed the link and took at least its serialisation time at the rate.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from protolearn.protocol.link import DEFAULT_BURST_BYTES

from tests.support.cli import CLI
from tests.support.swarm import DEMO_TOML as TINY

STEPS = 4
RATE_BYTES = 1e6  # 8mbit


def _events(work: Path, node: int, name: str) -> list[dict]:
    path = work / f"node{node}" / "node.jsonl"
    return [d for d in map(json.loads, path.read_text().splitlines()) if d["event"] == name]


def _demo(tmp_path: Path, name: str, *extra: str) -> Path:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    work = tmp_path / name
    r = subprocess.run([*CLI, "demo", "--nodes", "2", "--stages", "2", "--steps", str(STEPS), "--config", str(config), "--workdir", str(work), *extra],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens/s" in r.stdout.strip().splitlines()[-1]
    return work


@pytest.mark.slow
def test_a_slow_node_trains_the_same_values_and_pays_its_serialisation(tmp_path: Path) -> None:
    links = tmp_path / "links.txt"
    links.write_text("8mbit,20ms   # node 0: a slow home line\nnone         # node 1: unshaped\n")
    plain = _demo(tmp_path, "plain")
    shaped = _demo(tmp_path, "shaped", "--links", str(links))

    def losses(work: Path) -> list[float]:
        steps = [e for k in (0, 1) for e in _events(work, k, "step") if e["loss"] is not None]
        return [e["loss"] for e in sorted(steps, key=lambda e: e["step"])][:STEPS]

    assert len(losses(plain)) == STEPS
    assert losses(shaped) == losses(plain)

    assert not _events(shaped, 1, "link") and not _events(plain, 0, "link")
    (link,) = _events(shaped, 0, "link")
    assert link["spec"] == "8mbit,20ms"
    wire, up, down = link["wire"], link["up"], link["down"]
    sent, received = wire["conn_sent"] + wire["lane_sent"], wire["conn_received"] + wire["lane_received"]
    assert sent > 100_000 and received > 100_000  # activations out, gradients in (and the coordinator's traffic)
    # What the transport put on or took off its sockets is what passed the model (bar bytes still in flight).
    assert sent <= up["bytes"] < sent + 64 * 1024
    assert received == down["bytes"]
    for direction in (up, down):
        assert direction["serialisation_s"] >= direction["bytes"] / RATE_BYTES * (1 - 1e-9)
        assert direction["last_leave"] - direction["first_at"] >= (direction["bytes"] - DEFAULT_BURST_BYTES) / RATE_BYTES
    # Each step's breakdown is in the node's log (bench.py steptime reads it).
    step_times = _events(shaped, 0, "step_times")
    assert len(step_times) == STEPS
    assert {"compute_s", "transfer_s", "bubble_s", "averaging_s", "commit_s"} <= set(step_times[0])
