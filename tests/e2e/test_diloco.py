"""DiLoCo mode as a user runs it: `coordinator start` and four `node join` processes train with
``[sync] mode = "diloco"`` (H = 8, 96 steps, 2 stages x 2 replicas), and one replica is SIGKILLed mid-round and restarted.

What must hold (issue 24; DESIGN.md's invariants as DiLoCo restates them):

- I2: the replicas of a stage are identical after every outer sync (every replica that synced a round
  logs the same hash for it);
- I1: every ticket of every inner step is processed exactly once: per stage and step, no ticket is in two
  replicas' inner steps (the killed replica's earlier life included), and a step every replica of the
  stage applied holds all B tickets;
- the restarted replica rejoins at an outer boundary: it takes its stage's state after the last outer
  sync (its hash is the one that round's replicas logged), trains on, and takes part in the next round
  with the others' result (its stage is the coordinator's choice: its old one, or the other if it was
  away too long for its last reported hash to count);
- ``swarm status --json`` shows the mode, each stage's last outer round and each node's inner step.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

from tests.support.cli import CLI
from tests.support.swarm import TINY, Swarm

STEPS, B, H = 96, 4, 8
DEADLINE_S = 400.0
DILOCO = """
[sync]
mode = "diloco"
inner_steps = {h}
quorum = 2
grace_s = 2.0
"""


def _lives(s: Swarm, name: str) -> list[list[dict]]:
    """``name``'s event log split per process life (each starts with a ``start`` event)."""
    lives: list[list[dict]] = []
    for d in s.events(name):
        if d["event"] == "start" or not lives:
            lives.append([])
        lives[-1].append(d)
    return lives


def _stage(events: list[dict]) -> int:
    return next(d["stage"] for d in events if d["event"] == "built")


def _inner_steps(s: Swarm, name: str) -> int:
    return max((d["step"] for d in s.events(name, "step")), default=-1)


def test_a_diloco_swarm_survives_a_sigkill_and_the_replica_rejoins_at_an_outer_boundary(tmp_path: Path, rng: random.Random) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=STEPS, codec="none", layers=2, stages=2) + DILOCO.format(h=H))
    s = Swarm(tmp_path, config)
    names = [f"n{k}" for k in range(4)]
    try:
        addr = s.start_coordinator()
        for n in names:
            s.start_node(n, addr, "--checkpoint-every", str(H))
        s.wait_alive("all nodes built", lambda: all(s.events(n, "built") for n in names), 120, *names)
        by_stage: dict[int, list[str]] = {}
        for n in names:
            by_stage.setdefault(_stage(s.events(n)), []).append(n)
        assert sorted(len(v) for v in by_stage.values()) == [2, 2], by_stage
        victim = rng.choice(by_stage[1])
        # Mid-round: past the first outer sync, a few inner steps into the second round (the suite's seed picks which).
        kill_after = H + rng.randrange(1, H - 2)
        s.wait_alive(f"{victim} at inner step {kill_after}", lambda: _inner_steps(s, victim) >= kill_after, 180, *names)
        s.procs[victim].send_signal(signal.SIGKILL)
        s.procs[victim].wait(10)
        s.start_node(victim, addr, "--checkpoint-every", str(H))  # same data dir: same identity, it rejoins
        status = _status_json(addr, tmp_path)
        s.wait_nodes(names, DEADLINE_S)
    finally:
        s.stop()

    # The status names the mode, the stages' last outer rounds and the nodes' inner steps.
    assert status["schema_version"] == 5 and status["run"]["sync"] == "diloco" and status["run"]["inner_steps"] == H
    assert any(st["outer"] is not None for st in status["stages"]), status["stages"]
    assert all("inner_step" in n for n in status["nodes"])

    # Each process life by the stage it held. The restarted victim is placed as the coordinator decides: back in
    # its stage when the hash it last reported is still among its stage's recent ones, else like a newcomer
    # (registry._holds_stage_state), which in a fast run can be the other stage.
    lives: dict[int, dict[str, list[dict]]] = {}  # stage -> node -> the events of its lives there
    for n in names:
        for life in _lives(s, n):
            if any(d["event"] == "built" for d in life):
                lives.setdefault(_stage(life), {}).setdefault(n, []).extend(life)
    assert sorted(lives) == [0, 1], lives.keys()
    for stage, members in lives.items():
        # I2: one hash per outer round among the replicas that synced it.
        synced: dict[int, set[str]] = {}
        for events in members.values():
            for d in events:
                if d["event"] == "outer_sync" and not d["resync"]:
                    synced.setdefault(d["round"], set()).add(d["hash"])
        assert sorted(synced) == list(range(1, STEPS // H + 1)), f"stage {stage} synced rounds {sorted(synced)}"
        for round_, hashes in synced.items():
            assert len(hashes) == 1, f"I2: stage {stage} replicas differ after outer round {round_}: {hashes}"
        # I1: no ticket twice in one inner step of the stage, across all lives of its replicas.
        applied: dict[int, list[list[int]]] = {}
        for events in members.values():
            for d in events:
                if d["event"] == "step":
                    assert d["inner"], d
                    applied.setdefault(d["step"], []).append(d["tickets"])
        assert sorted(applied) == list(range(STEPS)), f"stage {stage}: steps {sorted(applied)}"
        for step, lists in applied.items():
            flat = [t for ts in lists for t in ts]
            assert len(flat) == len(set(flat)) and set(flat) <= set(range(B)), f"I1: stage {stage} step {step}: {lists}"
            if len(lists) == len(members):
                assert sorted(flat) == list(range(B)), f"I1: stage {stage} step {step}: {lists}"

    # The restarted replica took its stage's state after an outer sync, then synced the later rounds with the others.
    first, *later = _lives(s, victim)
    assert later, "the victim never restarted"
    again = [d for life in later for d in life]
    joined = [d["step"] for d in again if d["event"] == "joined"]
    assert joined and joined[0] < STEPS, f"the restarted victim joined at step {joined}, after the run ended (a machine too slow to start it)"
    (anchor,) = [d for d in again if d["event"] == "anchor"][:1]
    assert anchor["applied"] % H == 0 and anchor["applied"] >= H, anchor  # after an outer sync, never mid-round
    mate = next(n for n in lives[_stage(again)] if n != victim)
    mate_hash = {d["round"]: d["hash"] for d in lives[_stage(again)][mate] if d["event"] == "outer_sync" and not d["resync"]}
    assert anchor["hash"] == mate_hash[anchor["applied"] // H], (anchor, mate_hash)
    rounds_after = [d for d in again if d["event"] == "outer_sync" and not d["resync"]]
    assert rounds_after and all(d["hash"] == mate_hash[d["round"]] for d in rounds_after), rounds_after
    assert max(d["step"] for d in again if d["event"] == "step") == STEPS - 1


def _status_json(addr: str, tmp: Path) -> dict:
    out = subprocess.run([*CLI, "swarm", "status", "--coordinator", addr, "--json"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)
