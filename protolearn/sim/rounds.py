"""Each stage's averaging rounds in the simulation, and the left-out replicas' fetches of their results.

A node core's :class:`~protolearn.node.core.events.Average` joins the round of (stage, step, revision)
with the weights the frozen accounting gives (every participant names the same ones). The round is timed
and decided by :class:`~.round_model.RoundModel` from its participants' links, joins and deaths; every
survivor gets the same outcome (:class:`RoundDone` with the left-out replicas, or :class:`RoundFailed` with
its causes) one link delay after it ends, as the real collective guarantees. A replica that the
accounting leaves out :class:`~protolearn.node.core.events.Fetch`-es the result: it gets it (the full
vector over its down link) once the round ended with every contribution in, and a failure otherwise, or
when its try runs out first.

Each participant's time in a round is kept until the step commits: the round of the committed revision
was useful work, the others (failed, or superseded by a reopen) were not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from protolearn.node.core import events as ev
from protolearn.sim.finishing import result_hash
from protolearn.sim.round_model import Outcome, Participant, RoundModel
from protolearn.sim.world import SimNode, World

Key = tuple[int, int, int]  # (stage, step, revision)


@dataclass
class Round:
    key: Key
    model: RoundModel
    token: int = 0
    outcome: Outcome | None = None
    fetchers: list[tuple[SimNode, ev.Fetch, float, int]] = field(default_factory=list)
    spent: list[float] = field(default_factory=list)  # each survivor's seconds in it


class Rounds:
    """The open and recent rounds of every stage."""

    def __init__(self, world: World, feed: Callable[[SimNode, ev.Event], None], results: dict[SimNode, str]) -> None:
        """``feed(node, event)``: hand the node core its round's outcome; ``results``: each node's result hash."""
        self.w = world
        self.feed = feed
        self.results = results
        self.rounds: dict[Key, Round] = {}
        self._of_peer: dict[str, set[Key]] = {}
        self.timeout_s = world.scenario.node.averaging_timeout_s
        # A run that drops departures serves a round that left replicas out too: it is the step's result.
        self.drop = world.scenario.run.batch.departures == "drop"

    def _round(self, stage: int, step: int, revision: int, weights: dict[str, float]) -> Round:
        key = (stage, step, revision)
        r = self.rounds.get(key)
        if r is None:
            vector = self.w.costs.stages[stage].sync_bytes
            members = {p: Participant(self.w.nodes[p].wire, w) for p, w in weights.items()}
            r = self.rounds[key] = Round(key, RoundModel(vector, self.timeout_s, members))
            self.w.metrics.round_sizes[len(members)] += 1
            for p, m in members.items():
                self._of_peer.setdefault(p, set()).add(key)
                node = self.w.nodes[p]
                if not node.alive or node.stage != stage:
                    m.gone_at, m.silent = self.w.now, node.silent
        return r

    # -- participants ------------------------------------------------------------------------------------
    def join(self, node: SimNode, a: ev.Average) -> None:
        r = self._round(node.stage, a.step, a.revision, a.weights)
        if r.outcome is not None or node.peer not in r.model.members:
            # It came after the round ended without it: nobody waits for its parts.
            self.w.engine.after(node.wire.delay_s, self.feed, node, ev.RoundFailed(a.step, a.revision, "the round ended without this replica"))
            return
        node.averaging_since = self.w.now
        r.model.join(node.peer, self.w.now)
        self._settle(r)

    def gone(self, node: SimNode) -> None:
        """``node`` died, went silent, or dropped its stage's rounds (a resync, a move)."""
        for key in self._of_peer.pop(node.peer, set()):
            r = self.rounds.get(key)
            if r is not None and r.outcome is None:
                r.model.gone(node.peer, self.w.now, silent=node.silent)
                self._settle(r)
        node.averaging_since = None

    def _settle(self, r: Round) -> None:
        out = r.model.projected()
        r.token += 1
        if out is not None:
            self.w.engine.at(out.ended_at, self._end, r, r.token)

    def _end(self, r: Round, token: int) -> None:
        if token != r.token or r.outcome is not None:
            return
        out = r.model.projected()
        if out is None:
            return
        r.outcome = out
        stage, step, revision = r.key
        rec = self.w.metrics.step(step)
        n = len(r.model.members)
        if not out.ok:
            rec.round_failures += 1
        if out.excluded:
            rec.round_exclusions += len(out.excluded)
        digest = result_hash(stage, step, revision, out.excluded)
        for p, m in r.model.members.items():
            node = self.w.nodes[p]
            self._of_peer.get(p, set()).discard(r.key)
            if m.gone_at is not None or m.joined_at is None or not node.alive or node.silent:
                continue
            self.w.metrics.sync_bytes += 2.0 * r.model.vector_bytes * (n - 1) / n
            r.spent.append(out.ended_at - m.joined_at)
            node.averaging_since = None
            if out.ok:
                self.results[node] = digest
                event: ev.Event = ev.RoundDone(step, revision, list(out.excluded))
            else:
                event = ev.RoundFailed(step, revision, out.reason, tuple(c for c in out.causes if c != p))
            self.w.engine.after(node.wire.delay_s, self.feed, node, event)
        for node, a, give_up, epoch in r.fetchers:
            self._answer_fetch(r, node, a, epoch)
        r.fetchers.clear()
        self._prune(step)

    def _prune(self, step: int) -> None:
        for key in [k for k, r in self.rounds.items() if k[1] < step - 4 and r.outcome is not None]:
            del self.rounds[key]

    # -- left-out replicas ------------------------------------------------------------------------------
    def fetch(self, node: SimNode, a: ev.Fetch) -> None:
        key = (node.stage, a.step, a.revision)
        r = self.rounds.get(key)
        if r is None:
            r = self._round(node.stage, a.step, a.revision, a.weights)
        if r.outcome is not None:
            self._answer_fetch(r, node, a, node.epoch)
            return
        give_up = self.w.now + a.try_s
        r.fetchers.append((node, a, give_up, node.epoch))
        self.w.engine.at(give_up, self._fetch_timeout, r, node, a, node.epoch)

    def _fetch_timeout(self, r: Round, node: SimNode, a: ev.Fetch, epoch: int) -> None:
        pending = [f for f in r.fetchers if f[0] is node and f[3] == epoch and f[1] is a]
        if not pending or r.outcome is not None:
            return
        r.fetchers = [f for f in r.fetchers if f not in pending]
        if node.epoch == epoch:
            self.feed(node, ev.Fetched(a.step, a.revision, ok=False, reason="no participant served the result"))

    def _answer_fetch(self, r: Round, node: SimNode, a: ev.Fetch, epoch: int) -> None:
        if node.epoch != epoch or not node.alive:
            return
        out = r.outcome
        assert out is not None
        if out.ok and (not out.excluded or self.drop):
            stage, step, revision = r.key
            self.results[node] = result_hash(stage, step, revision, out.excluded)  # the participants' very result
            delay = r.model.vector_bytes / node.wire.down_rate + 2.0 * node.wire.delay_s
            self.w.metrics.sync_bytes += r.model.vector_bytes
            self.w.engine.after(delay, self._fetched, node, ev.Fetched(a.step, a.revision, ok=True), epoch)
            return
        why = "the round failed at every other participant" if not out.ok else "the round left replicas out: the step is redone"
        self.w.engine.after(node.wire.delay_s, self._fetched, node, ev.Fetched(a.step, a.revision, ok=False, reason=why), epoch)

    def _fetched(self, node: SimNode, event: ev.Event, epoch: int) -> None:
        if node.epoch == epoch:
            self.feed(node, event)

    # -- what the rounds cost -------------------------------------------------------------------------
    def settle_step(self, step: int, revision: int) -> tuple[float, float]:
        """(useful, wasted) seconds of the rounds of ``step``: those of the committed ``revision`` were useful."""
        useful = wasted = 0.0
        for (_, s, rev), r in self.rounds.items():
            if s == step and r.spent:
                if rev == revision and r.outcome is not None and r.outcome.ok:
                    useful += sum(r.spent)
                else:
                    wasted += sum(r.spent)
                r.spent = []
        return useful, wasted
