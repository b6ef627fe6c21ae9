"""A Byzantine member in the node-core simulator (issue 27, item 10): it may send any message it can sign.

Each schedule runs the simulated swarm of :mod:`node_sim` (2 stages, real node cores, the real coordinator
core) with adversaries from :mod:`sim_adversary` in one stage: one of three replicas, or two colluding of
five. Each schedule draws a strategy (random messages, or one of the named attacks) and the adversaries'
seeded choices. After every schedule:

- no honest replica is banned or struck: none carries a redo-storm, result-mismatch, late-lease or
  commit-hold strike (the claims the adversaries file, ``integrity`` and ``lost_microbatches``, are shown
  in status and never strike). The last two are the coordinator's own observations of an honest replica
  that an adversary slowed (a withholder downstream sat on its tickets, or it kept reopening the step):
  costs go to their cause, so they must land on nobody honest;
- every step's committed hash of each stage is an honest one, and no honest replica installed an
  adversary's state;
- honest replicas apply every step with exactly its B tickets (I1) and agree with each other (I2);
- progress: the honest replicas finish the 6 steps within :data:`RUN_S` of simulated time.

``PROTOLEARN_ADVERSARY_SEEDS=a:b`` runs another range (the closing note's full count is 0:2000 per layout);
a failure prints its seed, strategy and fault log.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.unit.node_sim import SETTINGS, STALL_S, Sim
from tests.unit.sim_adversary import STRATEGIES, Adversary

SEEDS = range(*map(int, os.environ.get("PROTOLEARN_ADVERSARY_SEEDS", "0:400").split(":")))
STEPS = 6
RUN_S = 120.0  # simulated seconds for 6 steps (without an adversary: median 2.3 s, at most 2.7 s over 100 seeds)
# Strikes an adversary must never bring on an honest replica.
NEVER = ("redo_storm", "result_mismatch", "late_leases", "commit_hold")
# Leases as long against the stall deadline as the defaults are (lease_s 20 s, late at half of it, a stall
# deadline of a few seconds): a stage-0 replica finds an overdue gradient before its lease turns late.
ADVERSARY_SETTINGS = SETTINGS.model_copy(update={"lease_s": 5 * STALL_S})


def run_schedule(seed: int, replicas: int, adversaries: int, tmp) -> tuple[Sim, Adversary]:
    rng = random.Random(seed)
    sim = Sim(seed, tmp, stages=2, replicas=replicas, steps=STEPS, settings=ADVERSARY_SETTINGS)
    stage = rng.randrange(sim.S)
    bad = rng.sample(sorted(n.peer for n in sim.stage_nodes(stage)), adversaries)
    adv = Adversary(sim, bad, STRATEGIES[seed % len(STRATEGIES)], rng)
    sim.run_until_done(limit_s=RUN_S)
    return sim, adv


def check(sim: Sim, adv: Adversary) -> None:
    honest = [n for n in sim.nodes.values() if n.peer not in sim.adversaries]
    banned = set(sim.coord.verdicts.bans)
    assert not banned & {n.peer for n in honest}, f"honest replicas banned: {sorted(banned - sim.adversaries)}"
    for n in honest:
        strikes = [f for f in sim.coord.verdicts.flags_of(n.peer) if f.split(":")[0] in NEVER]
        assert not strikes, f"{n.peer} struck: {strikes}"
    assert sim.finished(), f"no progress in {RUN_S:.0f} s: applied {[(n.peer, n.core.applied) for n in honest]}"
    for step, by_stage in sim.committed.items():
        assert not any(h.startswith("forged") or h == "f" * 64 for h in by_stage.values()), f"step {step} committed {by_stage}"
    full = tuple(range(sim.B))
    for n in honest:
        assert (-1,) not in n.params, f"{n.peer} installed an adversary's state"
        for step, tickets in enumerate(n.params):
            assert tickets == full, f"I1: {n.peer} applied step {step} with tickets {tickets}"
    for s in range(sim.S):
        replicas = [n for n in honest if n.stage == s and not n.moved]
        for a in replicas:
            for b in replicas:
                k = min(len(a.params), len(b.params))
                assert a.params[:k] == b.params[:k], f"I2: {a.peer} and {b.peer} differ"


@pytest.mark.parametrize(("replicas", "adversaries"), [(3, 1), (5, 2)], ids=["1-of-3", "2-of-5"])
@pytest.mark.parametrize("block", range(4))
def test_an_adversary_that_signs_anything_bans_nobody_honest_and_never_commits(replicas: int, adversaries: int, block: int, tmp_path) -> None:
    seeds = [s for s in SEEDS if s % 4 == block]
    print(f"seeds {seeds[0]}..{seeds[-1]}, every 4th")
    slowest = 0.0
    for seed in seeds:
        sim, adv = run_schedule(seed, replicas, adversaries, tmp_path / f"s{seed}")
        slowest = max(slowest, sim.now)
        try:
            check(sim, adv)
        except AssertionError as err:
            detail = "\n".join(sim.log[-40:] + [f"{n.peer}: " + "; ".join(n.events[-8:]) for n in sim.nodes.values()])
            raise AssertionError(f"seed {seed} ({adv.strategy}, {adversaries} of {replicas}, adversaries {sorted(adv.peers)}): {err}\n"
                                 f"sent {adv.sent}, refused {adv.refused}\n{detail}") from None
    print(f"{len(seeds)} schedules; the slowest took {slowest:.1f} simulated s for {STEPS} steps")
