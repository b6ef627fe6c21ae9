"""Compressed replica sync as a user runs it: ``[sync] compression`` in the run config, nodes as subprocesses.

Two stages with two replicas each train a few steps under each compression. After every step the
replicas of a stage hold bit-identical parameters (I2, from the ``step`` events' hashes, and no
``replica_mismatch`` alarm), every step covers exactly its B tickets (I1), the loss falls, and the bytes
each replica sent to sync a step are well below what raw float32 costs.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_swarm import check_exact_batch
from tests.support.swarm import DEADLINE_S

# Raw float32 sync of 2 replicas: each sends half its vector (scatter) and its reduced half (gather).
# What a compression may cost at most, as a fraction of that (headers, fins and probes included).
AT_MOST = {"int8": 0.4, "topk:0.02": 0.15, "powersgd:2": 0.2}
# Steps that both replicas of a stage must have applied (and so synced together, compressed).
MIN_PAIRED_STEPS = 4


def two_by_two(s, sync_toml: str) -> dict[int, list[str]]:
    """Start a 2-stage swarm of 4 nodes under ``[sync]`` ``sync_toml``, run it to its end, and return each stage's
    nodes (two replicas each). The run starts once all four have joined (``--wait-for 4``): nodes that start seconds
    apart (3.5 s from start to join is common here) would otherwise miss most of its few steps."""
    s.config.write_text(s.config.read_text() + f"[sync]\n{sync_toml}")
    addr = s.start_coordinator("--wait-for", "4")
    names = [f"n{k}" for k in range(4)]
    for n in names:
        s.start_node(n, addr)
    s.wait_nodes(names, DEADLINE_S)
    by_stage: dict[int, list[str]] = {}
    for n in names:
        by_stage.setdefault(s.events(n, "built")[0]["stage"], []).append(n)
    assert sorted(len(v) for v in by_stage.values()) == [2, 2], by_stage
    return by_stage


@pytest.mark.parametrize("compression", sorted(AT_MOST))
def test_two_stages_two_replicas_stay_identical_under_compressed_sync(swarm, compression: str) -> None:
    steps, B = 10, 4
    s = swarm(steps=steps, codec="none", layers=2, stages=2)
    by_stage = two_by_two(s, f'compression = "{compression}"\n')
    for stage, members in by_stage.items():
        numel = s.events(members[0], "built")[0]["params"]
        records = {n: {d["step"]: d for d in s.events(n, "step")} for n in members}
        for n in members:
            assert not s.events(n, "replica_mismatch") and not s.events(n, "tickets_lost"), n
        compared = 0
        for t in range(steps):
            logged = [records[n][t] for n in members if t in records[n]]
            assert logged, f"stage {stage}: no replica applied step {t}"
            assert len({d["hash"] for d in logged}) == 1, f"stage {stage}: replicas differ after step {t} under {compression}"
            compared += len(logged) == 2
            check_exact_batch(stage, t, logged, B)
            for d in logged:
                if d["sync_bytes"] is not None and len(d["replicas"]) == 2:
                    assert 0 < d["sync_bytes"] < AT_MOST[compression] * 4 * numel, (stage, t, d["sync_bytes"], numel)
        # Every node joined before step 0, but a replica that a loaded machine builds and syncs slowly may still miss the
        # first steps (2.5 s from its join to its state once, in a CI run with the cores kept busy); the steps both
        # applied must still be several.
        assert compared >= MIN_PAIRED_STEPS, f"stage {stage}: both replicas applied only {compared} of {steps} steps"
    losses = [d["loss"] for d in s.events(by_stage[0][0], "step")]
    assert losses[-1] < losses[0], losses


def test_a_diloco_swarm_averages_its_pseudo_gradients_int8_compressed(swarm) -> None:
    """``[sync] mode = "diloco"`` with ``compression = "int8"``: the outer rounds' pseudo-gradients go through the
    same compressed replica sync; after every outer round the replicas of a stage that synced hold one hash, and a
    round of two participants sends well below raw float32."""
    steps, h = 8, 2
    s = swarm(steps=steps, codec="none", layers=2, stages=2)
    by_stage = two_by_two(s, f'mode = "diloco"\ninner_steps = {h}\nquorum = 2\ngrace_s = 2.0\ncompression = "int8"\n')
    paired = 0
    for stage, members in by_stage.items():
        numel = s.events(members[0], "built")[0]["params"]
        synced: dict[int, set[str]] = {}
        for n in members:
            assert not s.events(n, "replica_mismatch"), n
            for d in s.events(n, "outer_sync"):
                if d["resync"]:
                    continue
                synced.setdefault(d["round"], set()).add(d["hash"])
                if len(d["weights"]) == 2 and d["role"] == "participant":
                    paired += 1
                    assert 0 < d["sync_bytes"] < AT_MOST["int8"] * 4 * numel, (stage, d["round"], d["sync_bytes"], numel)
        assert sorted(synced) == list(range(1, steps // h + 1)), f"stage {stage}: rounds synced {sorted(synced)}"
        for round_, hashes in synced.items():
            assert len(hashes) == 1, f"stage {stage}: replicas differ after outer round {round_}: {hashes}"
    assert paired, "no outer round had two participants: nothing was compressed"
