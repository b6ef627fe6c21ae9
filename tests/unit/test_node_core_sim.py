"""The node core under 1,000+ seeded random schedules of events and faults (fake clock, real coordinator core).

Each schedule runs a small swarm in :mod:`node_sim` and injects faults: a SIGKILL at a random moment,
two replicas of one stage killed inside the same averaging round, a hang longer than the membership
expiry after which the node comes back, a hung peer (its compute hangs for good while it heartbeats:
it never joins a round, completes a lease or reports a result), a coordinator restart (SQLite-persisted
state, restored), and late joiners. After every schedule:

- I1: every replica applied each step with exactly the B tickets of that step, none twice;
- I2 and same decisions: the replicas of a stage hold the same parameters, and the survivors of a round
  all decided the same way (apply, or wait for the next revision);
- liveness: every node still alive (and not hung) finishes the run, and no node but a hung one is banned.

``PROTOLEARN_SIM_SEEDS=a:b`` runs another range of seeds; a failure prints its seed and fault log.
"""

from __future__ import annotations

import os
import random

import pytest

from protolearn.node.core import events as ev
from tests.unit.node_sim import Sim, SimNode

SEEDS = range(*map(int, os.environ.get("PROTOLEARN_SIM_SEEDS", "0:1040").split(":")))
HUNG_PEER_RUN_S = 60.0
KINDS = ("kill", "double_death_in_round", "hang_past_expiry", "coordinator_restart", "hung_peer")


def plan(sim: Sim, kind: str, rng: random.Random) -> None:
    nodes = list(sim.nodes.values())
    spared: set[str] = set()  # every stage keeps one replica that no fault touches
    for s in range(sim.S):
        spared.add(rng.choice(sim.stage_nodes(s)).peer)
    victims = [n for n in nodes if n.peer not in spared]
    if kind == "kill":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 1.2), lambda: sim.kill(v))
    elif kind == "double_death_in_round":
        stage = rng.randrange(sim.S)
        at_step = rng.randrange(sim.steps - 1)
        fired = []

        def on_average(node: SimNode, a: ev.Average) -> None:
            if fired or node.stage != stage or a.step != at_step:
                return
            others = [sim.nodes[p] for p in sorted(a.weights) if p != node.peer and sim.nodes[p].alive]
            if len(others) >= 2:
                fired.append(a.step)
                for o in others[:2]:
                    sim.kill(o)

        sim.on_average = on_average
    elif kind == "hang_past_expiry":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 1.2), lambda: sim.hang(v, rng.uniform(3.5, 6.0)))
    elif kind == "hung_peer":
        v = rng.choice(victims)
        sim.at(rng.uniform(0.05, 1.2), lambda: sim.hang_compute(v))
    elif kind == "coordinator_restart":
        sim.at(rng.uniform(0.05, 1.2), lambda: sim.restart_coordinator(rng.uniform(0.5, 3.0)))
    if rng.random() < 0.3 and kind != "double_death_in_round":
        extra = [n for n in victims if all(n.stage != o.stage for o in victims if o is not n)] or []
        if extra:
            v = rng.choice(extra)
            sim.at(rng.uniform(0.05, 1.5), lambda: sim.kill(v))
    if rng.random() < 0.2:
        sim.at(rng.uniform(0.1, 1.5), lambda: sim.add_node(f"late{len(sim.nodes)}") if sim.now >= sim.down_until else None)


def check(sim: Sim) -> None:
    full = tuple(range(sim.B))
    alive = [n for n in sim.nodes.values() if n.alive and not n.moved]
    assert sim.finished(), f"not finished: applied {[(n.peer, n.core.applied) for n in alive]}"
    hung = {n.peer for n in sim.nodes.values() if n.compute_hung}
    banned = set(sim.coord.verdicts.bans)
    assert banned <= hung, f"honest replicas banned: {sorted(banned - hung)}"
    for n in sim.nodes.values():
        for step, tickets in enumerate(n.params):
            assert tickets == full, f"I1: {n.peer} applied step {step} with tickets {tickets}"
    for s in range(sim.S):
        replicas = sim.stage_nodes(s)
        for a in replicas:
            for b in replicas:
                k = min(len(a.params), len(b.params))
                assert a.params[:k] == b.params[:k], f"I2: {a.peer} and {b.peer} differ"
        rounds = {key for n in replicas for key in n.survived}
        for key in rounds:
            decided = {n.peer: n.decisions[key] for n in replicas if key in n.survived and key in n.decisions}
            assert len(set(decided.values())) <= 1, f"survivors of stage {s} round {key} decided differently: {decided}"


@pytest.mark.parametrize("block", range(8))
def test_random_schedules_keep_i1_and_replicas_agree(block: int, tmp_path) -> None:
    seeds = [s for s in SEEDS if s % 8 == block]
    for seed in seeds:
        rng = random.Random(seed)
        kind = KINDS[seed % len(KINDS)]
        replicas = 3 if kind == "double_death_in_round" else rng.choice((2, 3))
        sim = Sim(seed, tmp_path / f"s{seed}", stages=2, replicas=replicas, steps=6)
        plan(sim, kind, rng)
        sim.run_until_done()
        try:
            check(sim)
            # Progress with a hung peer: 6 steps within HUNG_PEER_RUN_S of simulated time (a hung peer
            # holds a commit for at most one grace, 3 s, and no time once it is behind or banned).
            assert kind != "hung_peer" or sim.now <= HUNG_PEER_RUN_S, f"hung peer: the run took {sim.now:.1f} s"
        except AssertionError as err:
            detail = "\n".join(sim.log + [f"{n.peer}: " + "; ".join(n.events[-12:]) for n in sim.nodes.values()])
            raise AssertionError(f"seed {seed} ({kind}, {replicas} replicas/stage): {err}\n{detail}") from None
