"""DiLoCo mode under hundreds of seeded fault schedules (fake clock, real node cores, the real coordinator core).

Each schedule runs :mod:`diloco_sim` (2 stages, 2 or 3 replicas each, H = 2 over 6 steps, quorum 2) and
injects one fault: a SIGKILL at a random moment, a replica killed as its stage's outer round starts, a
hang past the membership expiry, a hung peer (it heartbeats and never computes), a coordinator restart
from SQLite; sometimes a second kill and a late joiner. After every schedule, DESIGN.md's invariants as
DiLoCo restates them:

- I1: every ticket of every inner step is processed exactly once: each replica's inner step applied
  exactly the tickets the coordinator's final accounting gives it (or none: a step committed without it),
  so no ticket is in two replicas' steps of a stage;
- I2: the replicas of a stage are identical after every outer sync (the same anchor: the same rounds, each
  with the same contributions);
- liveness: every live replica finishes the run, and no honest one is banned. A hung peer (in a stage of
  two, it is half of the reporters a joiner's state must agree with) is expelled after missing 4 outer rounds
  in a row, so its schedules run 12 steps.

``PROTOLEARN_SIM_SEEDS=a:b`` runs another range; a failure prints its seed and fault log.
"""

from __future__ import annotations

import os
import random

import pytest

from protolearn.node.core import events as ev
from tests.unit.diloco_sim import DilocoSim
from tests.unit.node_sim import SimNode

SEEDS = range(*map(int, os.environ.get("PROTOLEARN_DILOCO_SIM_SEEDS", "0:400").split(":")))
KINDS = ("kill", "kill_in_outer_round", "hang_past_expiry", "coordinator_restart", "hung_peer")
STEPS = 6


def plan(sim: DilocoSim, kind: str, rng: random.Random) -> None:
    spared = {rng.choice(sim.stage_nodes(s)).peer for s in range(sim.S)}  # every stage keeps one untouched replica
    victims = [n for n in sim.nodes.values() if n.peer not in spared]
    if kind == "kill":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 2.0), lambda: sim.kill(v))
    elif kind == "kill_in_outer_round":
        stage, round_ = rng.randrange(sim.S), rng.randrange(1, STEPS // sim.H + 1)
        fired: list[int] = []

        def on_sync(node: SimNode, a: ev.SyncOuter) -> None:
            if fired or node.stage != stage or a.round != round_:
                return
            others = [o for o in sim.stage_nodes(stage) if o is not node and o.alive and o.peer not in spared]
            if others:
                fired.append(a.round)
                sim.kill(rng.choice(others))

        sim.on_sync = on_sync
    elif kind == "hang_past_expiry":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 2.0), lambda: sim.hang(v, rng.uniform(3.5, 6.0)))
    elif kind == "hung_peer":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 2.0), lambda: sim.hang_compute(v))
    elif kind == "coordinator_restart":
        sim.at(rng.uniform(0.05, 2.0), lambda: sim.restart_coordinator(rng.uniform(0.5, 3.0)))
    if rng.random() < 0.3:
        extra = [n for n in victims if all(n.stage != o.stage for o in victims if o is not n)]
        if extra:
            v = rng.choice(extra)
            sim.at(rng.uniform(0.05, 2.5), lambda: sim.kill(v))
    if rng.random() < 0.3:
        sim.at(rng.uniform(0.1, 2.5), lambda: sim.add_node(f"late{len(sim.nodes)}") if sim.now >= sim.down_until else None)


def check(sim: DilocoSim) -> None:
    alive = [n for n in sim.nodes.values() if n.alive and not n.moved]
    assert sim.finished(), f"not finished: applied {[(n.peer, n.core.applied, n.core.phase.value) for n in alive]}"
    hung = {n.peer for n in sim.nodes.values() if n.compute_hung}
    banned = set(sim.coord.verdicts.bans)
    assert banned <= hung, f"honest replicas banned: {sorted(banned - hung)}"
    for (stage, step), applied in sorted(sim.inner.items()):
        closed = sim.coord.ledger.closed.get(step)
        assert closed is not None and sim.coord.ledger.committed(step), f"step {step} applied but not committed"
        accounted = {p: tuple(ts) for p, ts in closed.accounting().get(stage, {}).items()}
        for peer, tickets in applied.items():
            # I1: exactly its accounted tickets, or none (the step committed without it: they are lost with it).
            assert tickets in ((), accounted.get(peer, ())), f"I1: {peer} stage {stage} step {step} applied {tickets}, accounted {accounted.get(peer)}"
        seen = [t for ts in applied.values() for t in ts]
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(sim.B)), f"I1: stage {stage} step {step} tickets {applied}"
    for (stage, round_), anchors in sorted(sim.anchors.items()):
        assert len(set(anchors.values())) == 1, f"I2: stage {stage} replicas differ after outer round {round_}: {sorted(anchors)}"
    for n in alive:
        if n.peer not in hung and n.peer not in banned:
            r = sim.replicas[n.peer]
            assert r.anchor_applied == sim.steps, f"{n.peer} did not finish on the last outer sync (anchor after {r.anchor_applied})"


@pytest.mark.parametrize("block", range(4))
def test_diloco_schedules_keep_i1_per_inner_step_and_i2_after_every_outer_sync(block: int, tmp_path) -> None:
    for seed in [s for s in SEEDS if s % 4 == block]:
        rng = random.Random(seed)
        kind = KINDS[seed % len(KINDS)]
        steps = 2 * STEPS if kind == "hung_peer" else STEPS
        sim = DilocoSim(seed, tmp_path / f"s{seed}", stages=2, replicas=rng.choice((2, 3)), steps=steps, inner_steps=2, quorum=2)
        plan(sim, kind, rng)
        sim.run_until_done(limit_s=600.0)
        try:
            check(sim)
        except AssertionError as err:
            detail = "\n".join(sim.log + [f"{n.peer}: " + "; ".join(n.events[-14:]) for n in sim.nodes.values()])
            raise AssertionError(f"seed {seed} ({kind}): {err}\n{detail}") from None


def test_a_fault_free_diloco_run_syncs_every_h_steps_with_every_replica() -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        sim = DilocoSim(1, Path(tmp), stages=2, replicas=2, steps=STEPS, inner_steps=2, quorum=2)
        sim.run_until_done()
        check(sim)
        assert sorted(r for _, r in sim.anchors) == [1, 1, 2, 2, 3, 3]
        for (stage, round_), anchors in sim.anchors.items():
            assert len(anchors) == 2, f"stage {stage} round {round_} synced only {sorted(anchors)}"
        # Every inner step of every stage holds all B tickets, split between the two replicas.
        for (stage, step), applied in sim.inner.items():
            assert sorted(t for ts in applied.values() for t in ts) == list(range(sim.B)), (stage, step, applied)
