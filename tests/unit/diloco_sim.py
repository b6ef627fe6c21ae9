"""The fake-clock swarm of :mod:`node_sim` in DiLoCo mode: real inner-step and outer-round cores, the real coordinator.

Every node runs an :class:`~protolearn.node.core.inner_step.InnerStepCore` and, per outer round, an
:class:`~protolearn.node.core.outer_round.OuterRoundCore`; the coordinator is the real core with its outer
rounds (``coordinator/core/outer_rounds.py``). What is modelled besides :mod:`node_sim`'s pipeline: a
replica's state is its **anchor** (the outer rounds it synced through, each the set of contributions the
round's collective kept) plus the **inner steps** it applied since (each the tickets it applied); the outer
collective is modelled like :mod:`node_sim`'s (the survivors all get the same outcome, and with two or
more left out it may fail outright, to be retried); a joiner or a replica left out takes a live donor's
anchor, once it is the one a strict majority of its stage reports, and only the one the open step's
round started from (a joiner syncs at an outer boundary).

What the checks read: :attr:`DilocoSim.inner` (every inner step each replica applied, with its tickets),
:attr:`DilocoSim.anchors` (each replica's anchor after each outer round it finished).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protolearn.coordinator.core.outer_rounds import OuterSpec
from protolearn.coordinator.errors import Refusal
from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from protolearn.node.core import outer_round as orc
from protolearn.node.core.inner_step import InnerStepCore, outer_round_of
from protolearn.protocol import coordination as cm
from tests.unit.node_sim import HOP_S, POLL_S, ROUND_TIMEOUT_S, SETTINGS, Sim, SimNode, Unavailable

Contribution = tuple[str, tuple[tuple[int, tuple[int, ...]], ...]]  # (peer, its inner steps since the anchor)
Anchor = tuple[tuple[int, tuple[Contribution, ...]], ...]  # (round, the contributions its collective kept), in order


@dataclass
class Replica:
    anchor: Anchor = ()
    anchor_applied: int = 0
    since_step: int = 0
    steps: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # inner steps since the anchor
    outer: orc.OuterRoundCore | None = None
    sync_step: int = -1
    result: tuple[Contribution, ...] | None = None


@dataclass
class OuterRound:
    stage: int
    round_id: int
    participants: set[str]
    joined: dict[str, Contribution] = field(default_factory=dict)
    outcome: tuple[str, tuple[Contribution, ...], list[str]] | None = None


def anchor_hash(anchor: Anchor) -> str:
    return hashlib.sha256(repr(anchor).encode()).hexdigest()


class DilocoSim(Sim):
    def __init__(self, seed: int, tmp: Path, *, inner_steps: int = 2, quorum: int = 2, grace_s: float = 1.0, steps: int = 6, **kw) -> None:
        self.H = inner_steps
        self.replicas: dict[str, Replica] = {}
        self.outer_rounds: dict[tuple[int, int], OuterRound] = {}
        # (stage, step) → peer → the tickets its inner step applied; (stage, round) → peer → its anchor after it.
        self.inner: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
        self.anchors: dict[tuple[int, int], dict[str, Anchor]] = {}
        self.on_sync: Callable[[SimNode, ev.SyncOuter], None] | None = None
        spec = OuterSpec(inner_steps=inner_steps, steps=steps, quorum=quorum, grace_s=grace_s, tokens_per_ticket=1)
        super().__init__(seed, tmp, steps=steps, outer=spec, settings=kw.pop("settings", SETTINGS), **kw)

    # -- the hooks node_sim calls ---------------------------------------------------------------------
    def make_core(self, peer: str, stage: int) -> nc.NodeCore:
        self.replicas[peer] = Replica()
        return InnerStepCore(peer, stage, nc.CoreConfig(self.B, max_in_flight=self.B, max_deferred=self.B, averaging_timeout_s=10.0),
                             inner_steps=self.H, steps=self.steps)

    def heartbeat(self, node: SimNode) -> cm.Heartbeat:
        r = self.replicas[node.peer]
        anchored = r.anchor_applied > 0
        return cm.Heartbeat(state=node.core.state, step=r.anchor_applied - 1 if anchored else -1, stage=node.stage,
                            param_hash=anchor_hash(r.anchor) if anchored else "", inner_step=node.core.applied - 1)

    # -- taking the stage's state ---------------------------------------------------------------------
    def _sync(self, node: SimNode, *, first: bool = False) -> None:
        """A donor's anchor, once a strict majority of the stage reports it and it is the one the open step's
        outer round started from; the init on a fresh run (every replica starts from it)."""
        frontier = self._frontier()
        donors = [d for d in self.stage_nodes(node.stage) if d is not node and d.live(self.now) and d.core.state.live
                  and self.replicas[d.peer].anchor_applied >= 0]
        needed = self.H * (frontier // self.H) if frontier >= 0 else None
        fresh = [d for d in donors if needed is not None and self.replicas[d.peer].anchor_applied >= min(needed, self.steps)
                 and self._majority_holds_anchor(node.stage, self.replicas[d.peer])]
        if fresh:
            donor = self.rng.choice(fresh)
            self._take(node, self.replicas[donor.peer].anchor, self.replicas[donor.peer].anchor_applied, frontier)
        elif needed is not None and needed == 0 and (first or not donors):
            self._take(node, (), 0, frontier)  # the deterministic init is round 0's anchor
        else:
            self.to_node(node, 1.0, lambda: self._sync(node, first=first))

    def _majority_holds_anchor(self, stage: int, r: Replica) -> bool:
        if r.anchor_applied == 0:
            return True
        reports = self.coord.registry.stage_hashes(stage, cm.MAX_STAGE_HASHES)
        serving = {p for p, _, _ in reports} | set(self.coord.registry.serving(stage))
        votes = {p for p, step, h in reports if step == r.anchor_applied - 1 and h == anchor_hash(r.anchor)}
        return 2 * len(votes) > len(serving)

    def _take(self, node: SimNode, anchor: Anchor, applied: int, frontier: int) -> None:
        r = self.replicas[node.peer]
        r.anchor, r.anchor_applied, r.since_step, r.steps, r.outer = anchor, applied, frontier, [], None
        node.grads.clear()
        node.core.handle(ev.Synced(frontier), self.now)
        node.finishing = False
        node.events.append(f"{self.now:.2f} took anchor after {applied} steps, trains from {frontier}")
        self._beat(node)
        self._train(node)

    # -- the node core's actions ----------------------------------------------------------------------
    def _carry(self, node: SimNode, a: ev.Action) -> None:
        r = self.replicas[node.peer]
        if isinstance(a, (ev.Apply, ev.Skip)):
            tickets = tuple(a.tickets) if isinstance(a, ev.Apply) else ()
            r.steps.append((a.step, tickets))
            self.inner.setdefault((node.stage, a.step), {})[node.peer] = tickets
            node.decisions[(a.step, a.revision)] = "apply" if isinstance(a, ev.Apply) else "skip"
            node.grads.pop(a.step, None)
            for b in node.core.handle(ev.Applied(a.step, "inner"), self.now):
                self._carry(node, b)
            if node.core.phase is not nc.Phase.OUTER:
                node.finishing = False
                self._train(node)
            return
        if isinstance(a, ev.SyncOuter):
            if self.on_sync is not None:
                self.on_sync(node, a)
            r.outer, r.sync_step, r.result = orc.OuterRoundCore(node.peer, node.stage, a.round, a.step, ask_timeout_s=10.0), a.step, None
            self._outer_actions(node, r.outer.start(self.now))
            return
        if isinstance(a, ev.Resync):
            r.outer = None
        super()._carry(node, a)

    # -- an outer round -------------------------------------------------------------------------------
    def _outer_actions(self, node: SimNode, actions: list[orc.OuterAction]) -> None:
        r = self.replicas[node.peer]
        oc = r.outer
        if oc is None:
            return
        node.core.outer_attempt = oc.attempt
        for a in actions:
            if isinstance(a, ev.Emit):
                node.events.append(f"{self.now:.2f} {a.event} {a.fields}")
            elif isinstance(a, orc.AskReady):
                self._answer_outer(node, a.delay_s + HOP_S, lambda a=a: self._ask_ready(node, a))
            elif isinstance(a, orc.AverageOuter):
                self._outer_average(node, a)
            elif isinstance(a, orc.FetchOuter):
                self._outer_fetch(node, a)
            elif isinstance(a, orc.ApplyOuter):
                assert r.result is not None, f"{node.peer} installs an outer step without a result"
                r.anchor = r.anchor + ((oc.round, r.result),)
                r.anchor_applied = r.since_step = r.sync_step + 1
                r.steps = []
                self.anchors.setdefault((node.stage, oc.round), {})[node.peer] = r.anchor
                self._answer_outer(node, HOP_S, lambda: orc.Installed(anchor_hash(r.anchor)))
            elif isinstance(a, orc.Finish):
                r.outer = None
                node.events.append(f"{self.now:.2f} outer round {oc.round} {'resync: ' + a.reason if a.resync else 'synced'}")
                node.finishing = False
                for b in node.core.handle(ev.OuterDone(r.sync_step, a.param_hash, a.resync, a.reason), self.now):
                    self._carry(node, b)
                if not a.resync:
                    self._beat(node)
                    self._train(node)

    def _answer_outer(self, node: SimNode, delay: float, make: Callable[[], orc.OuterEvent | None]) -> None:
        r = self.replicas[node.peer]
        oc = r.outer

        def go() -> None:
            if r.outer is not oc or oc is None:
                return
            got = make()
            if got is not None:
                self._outer_actions(node, oc.handle(got, self.now))

        self.to_node(node, delay, go)

    def _ask_ready(self, node: SimNode, a: orc.AskReady) -> orc.OuterEvent | None:
        r = self.replicas[node.peer]
        msg = cm.OuterReady(stage=node.stage, round=a.round, attempt=a.attempt, since_step=max(0, r.since_step),
                            anchor_hash=anchor_hash(r.anchor) if r.anchor_applied > 0 else "", tokens=0)
        try:
            reply = self.request(node.peer, msg)
        except Unavailable as err:
            return orc.Unanswered(str(err))
        except Refusal as err:
            return orc.Decided("left_out", err.reason)
        assert isinstance(reply, cm.OuterDecision)
        if reply.role == "pending":  # the long poll: the coordinator answers once decided
            oc = r.outer
            self._answer_outer(node, POLL_S, lambda: self._ask_ready(node, a) if r.outer is oc else None)
            return None
        return orc.Decided(reply.role, reply.reason, {w.peer_id: w.weight for w in reply.weights}, tuple(reply.followers))

    def _outer_average(self, node: SimNode, a: orc.AverageOuter) -> None:
        r = self.replicas[node.peer]
        key = (node.stage, a.round_id)
        o = self.outer_rounds.get(key)
        if o is None:
            o = self.outer_rounds[key] = OuterRound(node.stage, a.round_id, set(a.weights))
            self.after(ROUND_TIMEOUT_S, lambda: self._outer_settle(o, timeout=True))
        if o.outcome is not None:
            self._answer_outer(node, HOP_S, lambda: orc.AverageFailed("the round ended without this replica"))
            return
        o.joined[node.peer] = (node.peer, tuple(r.steps))
        self._outer_settle(o)

    def _outer_settle(self, o: OuterRound, *, timeout: bool = False) -> None:
        if o.outcome is not None:
            return
        if [p for p in o.participants if p not in o.joined and self.nodes[p].alive and not timeout]:
            return
        ok = sorted(p for p in o.joined if self.nodes[p].alive and (not timeout or self.nodes[p].live(self.now)))
        excluded = sorted(o.participants - set(ok))
        failed = not ok or (len(excluded) >= 2 and self.rng.random() < 0.5)
        o.outcome = ("failed" if failed else "done", tuple(o.joined[p] for p in ok), excluded)
        for p in ok:
            node = self.nodes[p]
            kind, result, _ = o.outcome

            def tell(node: SimNode = node, kind: str = kind, result: tuple = result) -> orc.OuterEvent:
                if kind == "failed":
                    return orc.AverageFailed(f"replicas {excluded} left out")
                self.replicas[node.peer].result = result
                return orc.Averaged(tuple(c[0] for c in result))

            self._answer_outer(node, HOP_S, tell)

    def _outer_fetch(self, node: SimNode, a: orc.FetchOuter) -> None:
        """A participant that finished serves the round's result for up to ``try_s``, only a full round's (nobody
        left out), as the node's proven fetch takes nothing else (protocol/collective/result_proof.py)."""
        give_up = self.now + (a.try_s if a.try_s is not None else 10.0)

        def look() -> orc.OuterEvent | None:
            o = self.outer_rounds.get((node.stage, a.round_id))
            if o is not None and o.outcome is not None and o.outcome[0] == "done" and not o.outcome[2]:
                if any(self.nodes[p].live(self.now) for p in o.joined if p != node.peer and p not in o.outcome[2]):
                    self.replicas[node.peer].result = o.outcome[1]
                    return orc.Fetched(True)
            if self.now >= give_up:
                return orc.Fetched(False, "no participant served the result")
            self._answer_outer(node, POLL_S, look)
            return None

        self._answer_outer(node, HOP_S, look)

    def outer_round_of(self, step: int) -> int:
        return outer_round_of(step, self.H)
