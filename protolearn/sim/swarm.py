"""A whole simulated swarm: builds the world and its actors from a scenario, runs it, and settles what it measured.

:class:`Swarm` wires the pieces together (constructors only: each actor gets the calls it makes): the
coordinator (:mod:`.coordinator_host`, the real core), the nodes' lives (:mod:`.membership`), stage 0's
tickets (:mod:`.stage0`, the real lease core), the pipeline (:mod:`.pipeline`, the real accounting and
route core), the node cores' closed-step decisions (:mod:`.finishing`), the rounds (:mod:`.rounds`) and
the churn (:mod:`.churn`). When a step commits, the work that went into it is credited
(:mod:`.metrics`): each stage's compute of the tickets the committed accounting gives a node, and the
rounds of the committed revision.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from protolearn.coordinator.core.run import RunInfo
from protolearn.sim.churn import Churn
from protolearn.sim.coordinator_host import CoordinatorHost
from protolearn.sim.costs import RunCosts
from protolearn.sim.engine import Engine
from protolearn.sim.finishing import Finisher
from protolearn.sim.membership import Membership
from protolearn.sim.metrics import Metrics
from protolearn.sim.pipeline import Pipeline
from protolearn.sim.rounds import Rounds
from protolearn.sim.scenario import Scenario
from protolearn.sim.stage0 import LeaseDriver
from protolearn.sim.world import SimNode, World

SAMPLE_S = 5.0  # how often empty stages are counted


@dataclass(frozen=True)
class Outcome:
    """What :meth:`Swarm.run` leaves for the report."""

    world: World
    duration_s: float
    events: int


class Swarm:
    """One simulated run of a scenario."""

    def __init__(self, scenario: Scenario) -> None:
        engine = Engine()
        run = RunInfo.from_run(scenario.run)
        host = CoordinatorHost(engine, run, scenario.coordinator, persist=scenario.churn.coordinator_restart_at_s is not None)
        self.w = w = World(scenario, engine, host, RunCosts.of(scenario.run, scenario.sim.sync_compression), Metrics(), random.Random(scenario.swarm.seed))
        w.serving = [[] for _ in range(scenario.run.stages.num_stages)]
        self.driver = LeaseDriver(w, start=lambda n, step, t: self.pipeline.start_ticket(n, step, t))
        self.pipeline = Pipeline(w, on_stage0=self.driver.feed, on_peer_down=lambda n, p: self.driver.peer_down(n, p))
        self.finisher = Finisher(
            w, join_round=lambda n, a: self.rounds.join(n, a), fetch=lambda n, a: self.rounds.fetch(n, a), drive=self._drive,
            start_held=self._start_held, resync=lambda n, why: self.membership.resync(n, why), applied=self._applied,
        )
        self.rounds = Rounds(w, feed=self.finisher.feed, results=self.finisher.results)
        self.membership = Membership(
            w, rounds_gone=self.rounds.gone, forget=self.finisher.forget, train=self.finisher.train,
            peer_down=lambda n, p, departed: self.driver.peer_down(n, p, departed=departed), member_left=self.driver.member_left,
            resend=self.pipeline.resend,
        )
        host.on_closed = self._closed
        host.on_reopened = self._reopened
        host.on_committed = self._committed
        self.churn = Churn(w, arrive=self.membership.arrive, depart=self.membership.depart, crash_coordinator=host.crash)
        engine.after(SAMPLE_S, self._sample)
        engine.after(scenario.coordinator.housekeeping_interval_s, self._after_housekeeping)
        # Crashes whose step has not committed yet (for the time to recover from each).
        self._unrecovered: list[float] = []
        self._crashes_seen = 0

    # -- wiring --------------------------------------------------------------------------------------
    def _drive(self, node: SimNode, step: int) -> None:
        if node.lease is not None:
            self.driver.begin(node, step)

    def _start_held(self, node: SimNode, payloads: list) -> None:
        for step, ticket, route, nonce in payloads:
            self.pipeline.forward_received(node, step, ticket, route, nonce)

    def _applied(self, node: SimNode, step: int) -> None:
        """The router forgets the applied step's tickets (router._forget_applied)."""
        node.nonces = {k: v for k, v in node.nonces.items() if k[0] > step}

    def _after_housekeeping(self) -> None:
        self.membership.check_dropped()
        self.w.engine.after(self.w.scenario.coordinator.housekeeping_interval_s, self._after_housekeeping)

    def _sample(self) -> None:
        for s, peers in enumerate(self.w.serving):
            if not peers:
                self.w.metrics.empty_s[s] += SAMPLE_S
        self.w.engine.after(SAMPLE_S, self._sample)

    # -- the coordinator's news ------------------------------------------------------------------------
    def _closed(self, step: int, revision: int) -> None:
        self.w.metrics.step(step).closed_at.append(self.w.now)
        self.finisher.on_closed(step, revision)

    def _reopened(self, step: int) -> None:
        self.w.metrics.step(step).reopened += 1
        self.finisher.on_reopened(step)

    def _committed(self, step: int) -> None:
        w = self.w
        ledger = w.host.core.ledger
        for s in sorted(k for k in ledger.closed if k <= step):
            self._credit(s, ledger.closed[s])
        self.finisher.on_committed(step)

    def _credit(self, step: int, closed) -> None:  # closed: ClosedStep | None
        w, m = self.w, self.w.metrics
        rec = m.step(step)
        if rec.committed_at is not None:
            return
        rec.committed_at = w.now
        rec.revision = closed.revision if closed is not None else 0
        # A step closed at its quorum (batch.close_quorum) trained only the tickets it did not drop.
        tickets = w.scenario.run.batch.microbatches_per_step - (closed.dropped if closed is not None else 0)
        m.committed_tokens += tickets * w.costs.tokens_per_microbatch
        routes = closed.routes if closed is not None else ()
        for node in w.nodes.values():
            if not node.work:
                continue
            for key in [k for k in node.work if k[0] <= step]:
                secs = node.work.pop(key)
                t = key[1]
                if key[0] == step and t < len(routes) and len(routes[t]) > node.stage >= 0 and routes[t][node.stage] == node.peer:
                    m.useful_compute_s += secs
                else:
                    m.wasted_compute_s += secs
        useful, wasted = self.rounds.settle_step(step, rec.revision)
        m.useful_avg_s += useful
        m.wasted_avg_s += wasted
        closed_at = closed.closed_at if closed is not None else w.now
        self._unrecovered += [when for when, _ in m.crashes[self._crashes_seen:]]
        self._crashes_seen = len(m.crashes)
        while self._unrecovered and self._unrecovered[0] < closed_at:
            m.recoveries.append(w.now - self._unrecovered.pop(0))

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        w = self.w
        end = w.scenario.duration_s
        w.engine.run(end)
        for node in w.nodes.values():
            if node.alive:
                w.metrics.node_s += end - node.joined_at
                if node.syncing_since is not None:
                    w.metrics.sync_s += end - node.syncing_since
        w.host.close()
        return Outcome(w, end, w.engine.events)
