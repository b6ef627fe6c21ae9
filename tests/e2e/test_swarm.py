"""The swarm as a user runs it: `coordinator start` and `node join` as subprocesses on 127.0.0.1.

The central claim (DESIGN.md I3): with codec none and no faults, the swarm's loss at every step equals
the single-process reference trainer's (`train-local`) on the same run, and all replicas of a stage
hold bit-identical parameters after every step (I2), with every step covering exactly B tickets (I1).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


from tests.support.cli import CLI
from tests.support.swarm import DEADLINE_S, reference_losses


def check_exact_batch(stage: int, t: int, logged: list[dict], B: int) -> None:
    """I1 for step ``t`` of ``stage``, from the ``step`` events of the replicas that applied it.

    Each event names the step's participants in the stage (``replicas``, from the frozen accounting),
    the tickets it contributed (``tickets``) and, for a participant, the tickets whose gradients are in
    the average it applied (``counted``; None for a replica the accounting left out, which fetched the
    result). The average must hold exactly tickets 0..B-1, none twice, and the participants' own
    tickets must never overlap.
    """
    assert len({tuple(d["replicas"]) for d in logged}) == 1, f"stage {stage} step {t}: replicas saw different accountings"
    counted = [d["counted"] for d in logged if d["counted"] is not None]
    assert counted, f"stage {stage} step {t}: no participant logged the tickets it averaged: {logged}"
    for c in counted:
        assert c == list(range(B)), f"stage {stage} step {t}: averaged tickets {c}, want exactly 0..{B - 1} once each"
    tickets = sorted(i for d in logged for i in d["tickets"])
    assert len(set(tickets)) == len(tickets) and set(tickets) <= set(range(B)), f"stage {stage} step {t}: tickets {tickets}"
    if len(counted) == len(logged[0]["replicas"]):  # every participant logged the step
        assert tickets == list(range(B)), f"stage {stage} step {t}: participants hold tickets {tickets}"


def test_two_stages_two_replicas_reproduce_the_reference_trainer(swarm, tmp_path: Path) -> None:
    steps, B = 5, 4
    s = swarm(steps=steps, codec="none", layers=2, stages=2)
    addr = s.start_coordinator()

    # A wrong peer id in the address is one error line and exit 1, not a traceback.
    head, _, peer = addr.rpartition("/p2p/")
    wrong = f"{head}/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"
    bad = s.start_node("wrong", wrong)
    assert bad.wait(timeout=120) == 1
    assert "Traceback" not in s.err("wrong") and "error: cannot reach the coordinator" in s.err("wrong")

    names = [f"n{k}" for k in range(4)]
    for n in names:
        s.start_node(n, addr)
    ref = reference_losses(s.config, steps, tmp_path)
    s.wait_nodes(names, DEADLINE_S)

    by_stage: dict[int, list[str]] = {}
    for n in names:
        by_stage.setdefault(s.events(n, "built")[0]["stage"], []).append(n)
    assert sorted(len(v) for v in by_stage.values()) == [2, 2], by_stage

    for stage, members in by_stage.items():
        records = {n: {d["step"]: d for d in s.events(n, "step")} for n in members}
        final = {records[n][steps - 1]["hash"] for n in members if steps - 1 in records[n]}
        for n in members:
            applied = sorted(records[n])
            # The alarms a node raises itself (node/replica_hashes.py, node/core/closed_step.py): a replica whose parameters
            # differ from its stage's after a step (I2), and a step applied without some of its tickets (I1).
            for alarm in ("replica_mismatch", "tickets_lost"):
                assert not s.events(n, alarm), f"{n}: {alarm} {s.events(n, alarm)}"
            if not applied:
                # Built after the last step opened (the 5 steps take about a second on a quiet machine): it
                # synced the stage's final state instead, and holds what its replica holds.
                synced = s.events(n, "synced")
                assert synced and synced[-1]["applied"] == steps and {synced[-1]["hash"]} == final, f"{n} applied no step: {synced}"
                continue
            # A node that started late (a loaded machine) joined mid-run: it synced, then applied every step.
            assert applied == list(range(applied[0], steps)), f"{n} applied steps {applied}"
            assert applied[0] == 0 or s.events(n, "synced"), f"{n} started at step {applied[0]} without syncing"
        for t in range(steps):
            logged = [records[n][t] for n in members if t in records[n]]
            assert logged, f"stage {stage}: no replica applied step {t}"
            assert len({d["hash"] for d in logged}) == 1, f"stage {stage} replicas differ after step {t}"
            check_exact_batch(stage, t, logged, B)
            loss = logged[0]["loss"]
            assert abs(loss - ref[t]) <= 1e-3 * abs(ref[t]), f"step {t}: swarm {loss} vs reference {ref[t]}"


def test_three_stages_with_int8_codec_lower_the_loss(swarm) -> None:
    steps = 8
    s = swarm(steps=steps, codec="int8", layers=3, stages=3)
    addr = s.start_coordinator()
    names = [f"n{k}" for k in range(3)]
    for n in names:
        s.start_node(n, addr)
    s.wait_nodes(names, DEADLINE_S)
    assert sorted(s.events(n, "built")[0]["stage"] for n in names) == [0, 1, 2]
    losses = [d["loss"] for d in s.events("n0", "step")]
    assert len(losses) == steps
    assert losses[-1] < 0.9 * losses[0], losses


def test_three_stages_with_the_subspace_codec_train_what_train_local_trains(swarm, tmp_path: Path) -> None:
    # Issue 10: activations and gradients cross both boundaries as 8 fp16 coefficients per token (plus the
    # token id, which the middle stage passes on), and the swarm's loss is train-local's step by step.
    steps = 6
    s = swarm(steps=steps, codec="subspace", layers=3, stages=3)
    s.config.write_text(s.config.read_text() + "[subspace]\nrank = 8\n")
    addr = s.start_coordinator()
    names = [f"n{k}" for k in range(3)]
    for n in names:
        s.start_node(n, addr)
    in_loop = reference_losses(s.config, steps, tmp_path, "--codec-in-loop")
    exact = reference_losses(s.config, steps, tmp_path)
    s.wait_nodes(names, DEADLINE_S)
    assert sorted(s.events(n, "built")[0]["stage"] for n in names) == [0, 1, 2]
    losses = [d["loss"] for d in s.events("n0", "step")]
    assert len(losses) == steps and losses[-1] < losses[0], losses
    print(f"swarm {losses}\ntrain-local --codec-in-loop {in_loop}\ntrain-local {exact}")
    for t in range(steps):
        # The same arithmetic as the codec in train-local's loop (only the order of summing tickets differs) ...
        assert abs(losses[t] - in_loop[t]) <= 1e-4 * in_loop[t], f"step {t}: swarm {losses[t]} vs train-local --codec-in-loop {in_loop[t]}"
        # ... and within fp16 rounding of the coefficients of the model itself, which the reconstruction adds nothing to.
        assert abs(losses[t] - exact[t]) <= 2e-3 * exact[t], f"step {t}: swarm {losses[t]} vs train-local {exact[t]}"


def test_swarm_status_shows_each_nodes_reachability_and_path(swarm) -> None:
    """On loopback the coordinator dials every node back, so each is public and reached directly (issue 14)."""
    s = swarm(steps=10_000, codec="none", layers=1, stages=1)
    addr = s.start_coordinator()
    s.start_node("n0", addr)
    env = {**os.environ, "COLUMNS": "250"}
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run([*CLI, "swarm", "status", "--coordinator", addr, "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        st = json.loads(out.stdout)
        if st["nodes"] and st["nodes"][0]["path"]:
            break
        assert time.monotonic() < deadline, f"no node reported its path in 120 s: {st['nodes']} {s.err('n0')}"
        assert s.procs["n0"].poll() is None, s.err("n0")
        time.sleep(0.5)
    assert st["schema_version"] >= 3  # the NAT fields came with schema 3
    assert (st["nodes"][0]["reachability"], st["nodes"][0]["path"]) == ("public", "direct")
    (reach,) = s.events("n0", "reachability")
    assert reach["verdict"] == "public" and reach["addrs"][0].startswith("/ip4/127.0.0.1/") and reach["relay"] == ""
    table = subprocess.run([*CLI, "swarm", "status", "--coordinator", addr], capture_output=True, text=True, timeout=60, env=env)
    assert table.returncode == 0, table.stderr[-2000:]
    header = next(line for line in table.stdout.splitlines() if "peer" in line and "stage" in line and "flags" in line)
    assert "reach" in header and "path" in header
    row = next(line for line in table.stdout.splitlines() if st["nodes"][0]["peer_id"][-8:] in line)
    assert "public" in row and "direct" in row
