"""A fake-clock swarm: real node cores and the real coordinator core, a modelled network and collective.

Every node runs a :class:`~protolearn.node.core.closed_step.NodeCore` (and on stage 0 a
:class:`~protolearn.node.core.leasing.LeaseCore`); the coordinator is a real
:class:`~protolearn.coordinator.core.dispatch.CoordinatorCore` persisted to a real SQLite store, so a
coordinator restart restores what a crashed service would. What is modelled, because no sockets or
torch run here: the pipeline (a ticket's forward and gradient hop between replicas with a delay; a dead
or hung replica takes nothing), the collective (a round ends when every participant joined or is
dead or hung past the round timeout; the survivors all get the same outcome, as the real collective
guarantees; with two or more left out it may fail outright) and the parameters (a replica's state is
the list of ticket multisets it applied, so I1 and I2 are checked exactly).

Faults: SIGKILL of a node (its connection to the coordinator closes), a hang longer than the
membership expiry (events addressed to it wait until it resumes, as a SIGSTOPped process's socket
buffers do), and a coordinator restart (every request fails for a while, then the core is rebuilt
from SQLite).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.outer_rounds import OuterSpec
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.store import Store
from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from protolearn.node.core import leasing as lc
from protolearn.protocol.lost_reports import should_notice_departure, should_report
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement

HOP_S = 0.01  # one network hop
HEARTBEAT_S = 1.0
HOUSEKEEPING_S = 0.25
POLL_S = 0.1  # the long polls' answer delay when nothing changed
ROUND_TIMEOUT_S = 2.0
STALL_S = 2.0  # stage 0 restarts a ticket whose gradient has not come back
SEND_TIMEOUT_S = 1.0
SETTINGS = CoordinatorSettings(
    heartbeat_interval_s=HEARTBEAT_S, expiry_s=3.0, restart_grace_s=5.0, lease_s=4.0, disconnect_grace_s=0.5,
    lease_block=2, rate_per_s=1e6, rate_burst=1e6, rebalance_interval_s=1e9,
)


def _sim_sign(peer: str, data: bytes) -> bytes:
    """A simulated node's signature: only ``peer`` "knows" how to make it (the real one is Ed25519)."""
    import hashlib

    return hashlib.sha256(peer.encode() + b"\x00" + data).digest()


def _sim_verify(peer: str, data: bytes, signature: bytes) -> bool:
    return signature == _sim_sign(peer, data)


class Unavailable(Exception):
    """The coordinator is restarting: the request failed as a dial would."""


@dataclass
class SimNode:
    peer: str
    stage: int
    core: nc.NodeCore
    lease: lc.LeaseCore | None
    alive: bool = True
    hung_until: float = 0.0
    # Its compute hung for good while its event loop runs: it heartbeats (as "training") and nothing else.
    compute_hung: bool = False
    banned: bool = False
    # The worker: tickets whose parameter gradients are held, per step.
    grads: dict[int, set[int]] = field(default_factory=dict)
    # The parameters: the sorted ticket multiset of every applied step, in order.
    params: list[tuple[int, ...]] = field(default_factory=list)
    result: tuple[int, ...] | None = None
    waiting: tuple[int, int] | None = None  # (step, revision) the train loop waits to close
    finishing: bool = False
    moved: bool = False
    # (step, revision) → what the node decided after its round: "apply", "reopen" or "resync".
    decisions: dict[tuple[int, int], str] = field(default_factory=dict)
    round_seen: set[tuple[int, int]] = field(default_factory=set)
    # Rounds whose outcome reached this replica as a survivor: it must decide as the others did.
    survived: set[tuple[int, int]] = field(default_factory=set)
    events: list[str] = field(default_factory=list)
    # Stage 0: its leases' nonces by (step, ticket), which the real activation carries to the last stage.
    nonces: dict[tuple[int, int], bytes] = field(default_factory=dict)
    # Stage 0: the stage-1 peer each started ticket went to, microbatches each peer lost in a row, and when
    # each was last reported (node/driver.py's liveness reports).
    # Stage 0: (step, stage-1 replicas that sit out the rest of it), the last lease reply's word.
    avoid: tuple[int, set[str]] = (-1, set())
    handed: dict[tuple[int, int], tuple[str, float | None]] = field(default_factory=dict)  # peer, its membership's join time
    lost: dict[str, int] = field(default_factory=dict)
    reported_at: dict[str, tuple[float, int]] = field(default_factory=dict)

    def live(self, now: float) -> bool:
        return self.alive and now >= self.hung_until and not self.moved


@dataclass
class Round:
    stage: int
    step: int
    revision: int
    participants: set[str]
    started: float
    joined: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outcome: tuple[str, tuple[int, ...], list[str]] | None = None  # ("done"|"failed", result, excluded)


class Sim:
    def __init__(
        self, seed: int, tmp: Path, *, stages: int = 2, replicas: int = 2, tickets: int = 4, steps: int = 4, settings: CoordinatorSettings = SETTINGS,
        outer: OuterSpec | None = None,
    ) -> None:
        """``outer``: a DiLoCo run's outer rounds (tests/unit/diloco_sim.py drives them)."""
        self.rng = random.Random(seed)
        self.seed = seed
        self.tmp = tmp
        self.now = 0.0
        self.B = tickets
        self.S = stages
        self.steps = steps
        self.run = RunInfo(name="sim", run_hash="0" * 64, run_toml="", layers=(1,) * stages, microbatches_per_step=tickets, tokens_per_step=tickets,
                           outer=outer)
        self.store: Store | None = None  # opened at the first coordinator crash (SQLite only where it is needed)
        self.settings = settings
        self.coord = CoordinatorCore(self.run, settings, peer_id="coord", started_at=0.0, verify=_sim_verify)
        self.down_until = -1.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.nodes: dict[str, SimNode] = {}
        self.rounds: dict[tuple[int, int, int], Round] = {}
        self.on_average: Callable[[SimNode, ev.Average], None] | None = None
        self.log: list[str] = []
        # Replicas that report a made-up result hash for every step they finish (issue 12's attack 5).
        self.liars: set[str] = set()
        # Byzantine members (tests/unit/sim_adversary.py): liars whose state handed to a joiner is made up, and
        # whose own progress the run does not wait for. With any, a joiner takes only the state a strict
        # majority of its stage reported (the real rule, node/syncing.py); without, every live replica holds it.
        self.adversaries: set[str] = set()
        # Adversaries that fail every round they take part in for everyone else (a fin that leaves the others
        # out, sent to all): the others' collective names them as the cause.
        self.round_breakers: set[str] = set()
        # step → stage → the result hash the commit barrier committed it with.
        self.committed: dict[int, dict[int, str]] = {}
        for k in range(stages * replicas):
            self.add_node(f"n{k}")
        self.at(HOUSEKEEPING_S, self._housekeeping)

    # -- plumbing ----------------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def to_node(self, node: SimNode, delay: float, fn: Callable[[], None], *, heartbeat: bool = False) -> None:
        """Deliver ``fn`` to ``node`` after ``delay``; a hung node takes it when it resumes, a dead one never,
        and one whose compute hung takes only its heartbeats."""

        def deliver() -> None:
            if not node.alive or node.moved or node.banned or (node.compute_hung and not heartbeat):
                return
            if self.now < node.hung_until:
                self.at(node.hung_until, deliver)
                return
            fn()

        # Every message's delay varies (seeded), so each schedule interleaves the replicas differently.
        self.after(delay * self.rng.uniform(0.5, 2.0), deliver)

    def request(self, peer: str, msg: cm.Message) -> cm.Message:
        """One coordinator request now; raises Refusal, or Unavailable while it restarts."""
        if self.now < self.down_until:
            raise Unavailable("coordinator restarting")
        return self.coord.handle(peer, msg, self.now)

    def run_until_done(self, limit_s: float = 400.0) -> None:
        while self._queue:
            when, _, fn = heapq.heappop(self._queue)
            if when > limit_s:
                break
            self.now = max(self.now, when)
            fn()
            if self.finished():
                return

    def finished(self) -> bool:
        live = [n for n in self.nodes.values() if n.alive and not n.moved and not n.compute_hung and not n.banned and n.peer not in self.adversaries]
        return bool(live) and all(n.core.applied >= self.steps for n in live)

    # -- membership ----------------------------------------------------------------------------------
    def add_node(self, peer: str) -> SimNode:
        reply = self.request(peer, cm.Join(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0))
        assert isinstance(reply, cm.JoinReply)
        core = self.make_core(peer, reply.stage)
        lease = lc.LeaseCore(max_in_flight=self.B, lease_block=2, stall_s=STALL_S, last_stage=self.S == 1) if reply.stage == 0 else None
        node = SimNode(peer, reply.stage, core, lease)
        self.nodes[peer] = node
        self.after(0.0, lambda: self._sync(node, first=True))
        self.after(HEARTBEAT_S, lambda: self._heartbeat_loop(node))
        return node

    def make_core(self, peer: str, stage: int) -> nc.NodeCore:
        return nc.NodeCore(peer, stage, nc.CoreConfig(self.B, max_in_flight=self.B, max_deferred=self.B, averaging_timeout_s=10.0))

    def heartbeat(self, node: SimNode) -> cm.Heartbeat:
        return cm.Heartbeat(
            state=node.core.state, step=node.core.applied - 1, stage=node.stage,
            param_hash=_hash(node.params) if node.params else "",
        )

    def kill(self, node: SimNode) -> None:
        if not node.alive:
            return
        node.alive = False
        self.log.append(f"{self.now:.2f} kill {node.peer}")
        if self.now >= self.down_until:
            self.coord.connection_changed(node.peer, False, self.now)

    def hang_compute(self, node: SimNode) -> None:
        """Its compute never returns again; its heartbeats go on (a hung GPU, or a peer that answers and
        sends nothing): it never joins a round, completes a lease or reports a result."""
        node.compute_hung = True
        self.log.append(f"{self.now:.2f} compute of {node.peer} hangs for good")

    def hang(self, node: SimNode, seconds: float) -> None:
        node.hung_until = self.now + seconds
        self.log.append(f"{self.now:.2f} hang {node.peer} for {seconds:.1f}s")

    def restart_coordinator(self, outage_s: float) -> None:
        """Crash now. The service persists every change before it replies, so what the core has drained
        into SQLite at this moment is what a restarted coordinator finds."""
        if self.store is None:
            self.store = Store(self.tmp)
        self.store.apply(self.coord.drain())
        self.down_until = self.now + outage_s
        self.log.append(f"{self.now:.2f} coordinator down for {outage_s:.1f}s")

        def back() -> None:
            assert self.store is not None
            self.coord = CoordinatorCore(self.run, self.settings, peer_id="coord", started_at=self.now, verify=_sim_verify)
            self.coord.restore(**self.store.load(), now=self.now)
            for n in self.nodes.values():
                if not n.alive:
                    self.coord.connection_changed(n.peer, False, self.now)

        self.at(self.down_until, back)

    def _housekeeping(self) -> None:
        if self.now >= self.down_until:
            self.coord.housekeeping(self.now)
        self.after(HOUSEKEEPING_S, self._housekeeping)

    def _heartbeat_loop(self, node: SimNode) -> None:
        def beat() -> None:
            self._beat(node)
            self._heartbeat_loop(node)

        self.to_node(node, HEARTBEAT_S, beat, heartbeat=True)

    def _beat(self, node: SimNode) -> None:
        """One heartbeat; a node the coordinator forgot (it expired while hung) joins again."""
        hb = self.heartbeat(node)
        try:
            self.request(node.peer, hb)
        except Unavailable:
            return
        except Refusal as err:
            if err.code == "banned":
                node.banned = True
                self.log.append(f"{self.now:.2f} {node.peer} banned: leaves the sim")
                return
            if err.code != "not_member":
                raise
            try:
                again = self.request(node.peer, cm.Join(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0))
            except Refusal:
                return
            if isinstance(again, cm.JoinReply) and again.stage != node.stage:
                self.move_out(node, f"rejoined at stage {again.stage}: leaves the sim")

    def move_out(self, node: SimNode, why: str) -> None:
        """The coordinator placed ``node`` in another stage: it leaves this simulation, and its old stage's rounds
        no longer wait for it (its peers find it gone at once, as they do a dead one)."""
        node.moved = True
        for r in [r for r in self.rounds.values() if node.peer in r.participants and r.outcome is None]:
            self._settle(r)
        self.log.append(f"{self.now:.2f} {node.peer} {why}")

    def stage_nodes(self, stage: int) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.stage == stage]

    # -- a node's life -------------------------------------------------------------------------------
    def _sync(self, node: SimNode, *, first: bool = False) -> None:
        """Take a live replica's state, or the init on a fresh run; retry while there is no donor."""
        donors = [d for d in self.stage_nodes(node.stage) if d is not node and d.live(self.now) and d.core.state.live]
        if self.adversaries and self.now >= self.down_until:
            donors = [d for d in donors if self._majority_holds(node.stage, self._handed(d))]
        if not donors:
            if first and self._frontier() == 0:
                self._install(node, [])
                return
            self.to_node(node, 1.0, lambda: self._sync(node, first=first))
            return
        donor = self.rng.choice(donors)
        self._install(node, self._handed(donor))

    def _handed(self, donor: SimNode) -> list[tuple[int, ...]]:
        """The state ``donor`` hands a joiner: an adversary's is made up."""
        return list(donor.params) + ([(-1,)] if donor.peer in self.adversaries else [])

    def _majority_holds(self, stage: int, params: list[tuple[int, ...]]) -> bool:
        """Whether a strict majority of ``stage``'s serving replicas reported ``params``' hash for its step."""
        if not params:
            return self._frontier() == 0
        reports = self.coord.registry.stage_hashes(stage, cm.MAX_STAGE_HASHES)
        serving = {p for p, _, _ in reports} | set(self.coord.registry.serving(stage))
        votes = {p for p, step, h in reports if step == len(params) - 1 and h == _hash(params)}
        return 2 * len(votes) > len(serving)

    def _frontier(self) -> int:
        return self.coord.ledger.frontier if self.now >= self.down_until else -1

    def _install(self, node: SimNode, params: list[tuple[int, ...]]) -> None:
        node.params = params
        node.grads.clear()
        node.core.handle(ev.Synced(len(params)), self.now)
        node.finishing = False
        node.events.append(f"{self.now:.2f} synced applied={len(params)}")
        self._beat(node)  # a node heartbeats at once when it starts training
        self._train(node)

    def _train(self, node: SimNode) -> None:
        step = node.core.applied
        if step >= self.steps:
            return
        node.waiting = (step, 1)
        self._drive(node)
        self._wait_closed(node)

    def _wait_closed(self, node: SimNode) -> None:
        assert node.waiting is not None
        step, revision = node.waiting

        def poll() -> None:
            if node.waiting != (step, revision) or node.finishing:
                return
            try:
                info = self.coord.step_info(step, revision) if self.now >= self.down_until else None
            except Refusal:
                info = None
            if info is None or not info.closed:
                self._wait_closed(node)
                return
            node.waiting = None  # the drive loop ends when the node sees the step closed
            account = {pt.peer_id: list(pt.tickets) for sa in info.accounting if sa.stage == node.stage for pt in sa.peers}
            node.finishing = True
            node.result = None
            self._feed(node, ev.Closed(step, info.revision, account, info.loss, sorted(node.grads.get(step, ()))))

        self.to_node(node, POLL_S, poll)

    # -- the node core's actions ---------------------------------------------------------------------
    def _feed(self, node: SimNode, event: ev.Event) -> None:
        if not node.alive or node.moved:
            return
        for a in node.core.handle(event, self.now):
            self._carry(node, a)

    def _answer(self, node: SimNode, delay: float, make: Callable[[], ev.Event | None]) -> None:
        def go() -> None:
            ev = make()
            if ev is not None:
                self._feed(node, ev)

        self.to_node(node, delay, go)

    def _carry(self, node: SimNode, a: ev.Action) -> None:
        if isinstance(a, ev.Emit):
            node.events.append(f"{self.now:.2f} {a.event} {a.fields}")
        elif isinstance(a, ev.AskReported):
            def reported() -> ev.Event:
                applied = any(o is not node and o.live(self.now) and o.core.applied > a.step for o in self.stage_nodes(node.stage))
                return ev.Reported(a.step, applied)

            self._answer(node, a.delay_s + HOP_S, reported)
        elif isinstance(a, ev.Average):
            self._average(node, a)
        elif isinstance(a, ev.Fetch):
            self._fetch(node, a)
        elif isinstance(a, ev.Redo):
            def redo() -> ev.Event:
                try:
                    self.request(node.peer, cm.Redo(step=a.step, indices=a.tickets, reason=a.reason[:100], revision=a.revision,
                                                    kind=a.kind, causes=list(a.causes)))  # type: ignore[arg-type]
                except Refusal as err:
                    return ev.RedoAnswer(a.step, a.revision, granted=False, reason=str(err), code=err.code)
                except Unavailable as err:
                    return ev.RedoAnswer(a.step, a.revision, granted=None, reason=str(err))
                return ev.RedoAnswer(a.step, a.revision, granted=True)

            self._answer(node, a.delay_s + HOP_S, redo)
        elif isinstance(a, ev.AskReopened):
            def ask() -> ev.Event:
                if self.now < self.down_until:
                    return ev.ReopenAnswer(a.step, a.revision, reopened=None, reason="coordinator restarting")
                info = self.coord.step_info(a.step, a.revision + 1)
                return ev.ReopenAnswer(a.step, a.revision, reopened=info.closed or info.open_step == a.step)

            self._answer(node, a.delay_s + HOP_S, ask)
        elif isinstance(a, ev.WaitCommit):
            self._wait_commit(node, a.step, a.revision, a.report)
        elif isinstance(a, (ev.Apply, ev.Skip)):
            if isinstance(a, ev.Apply):
                assert node.result is not None, f"{node.peer} applies step {a.step} without a result"
            # A skipped step is applied with no update: the stage's result of it is lost.
            node.params.append(node.result if isinstance(a, ev.Apply) else ())  # type: ignore[arg-type]
            node.decisions[(a.step, a.revision)] = "apply" if isinstance(a, ev.Apply) else "skip"
            node.grads.pop(a.step, None)
            node.finishing = False
            for b in node.core.handle(ev.Applied(a.step, _hash(node.params)), self.now):
                self._carry(node, b)
            self._train(node)
        elif isinstance(a, ev.Resync):
            node.decisions.setdefault((node.core._step, node.core._revision), "resync")
            node.grads.clear()
            node.finishing = False
            self.to_node(node, HOP_S, lambda: self._sync(node))
        elif isinstance(a, ev.StartHeld):
            for step, ticket, route, sender in a.payloads:  # type: ignore[misc]
                self._forward_arrived(node, step, ticket, route, sender, admitted=True)
        elif isinstance(a, ev.WaitClosed):
            node.decisions.setdefault((a.step, a.revision - 1), "reopen")
            node.finishing = False
            node.waiting = (a.step, a.revision)
            self._drive(node)
            self._wait_closed(node)
        else:
            raise AssertionError(f"unexpected action {a!r}")

    def _wait_commit(self, node: SimNode, step: int, revision: int, report: bool) -> None:
        """The link's commit wait: report (if a participant) and long-poll until committed or reopened."""

        def poll(report: bool) -> None:
            if self.now < self.down_until:
                self.to_node(node, 1.0, lambda: poll(report))  # the link retries a failed request
                return
            info: cm.StepInfo | None = None
            if report:
                held = "" if node.result is None else _hash([node.result])
                if node.peer in self.liars:
                    held = f"forged-by-{node.peer}"
                averaged = cm.Averaged(step=step, revision=revision, result_hash=held)
                try:
                    info = self.coord.handle(node.peer, averaged, self.now)  # type: ignore[assignment]
                    barrier = self.coord.ledger.barrier
                    if barrier.committed_through >= 0:
                        self.committed.setdefault(barrier.committed_through, dict(barrier.hashes))
                except Refusal as err:
                    if err.code == "result_mismatch":
                        self._feed(node, ev.CommitAnswer(step, revision, False, refused=err.reason))
                        return
                    if err.code in ("stale_revision", "step_not_closed"):
                        self._feed(node, ev.CommitAnswer(step, revision, False))
                        return
                    self.to_node(node, 1.0, lambda: poll(report))
                    return
            if info is None or not info.committed:
                info = self.coord.step_info(step, revision)
            if info.committed and info.revision == revision:
                self._feed(node, ev.CommitAnswer(step, revision, True))
            elif not info.closed or info.revision != revision:
                self._feed(node, ev.CommitAnswer(step, revision, False))
            else:
                self.to_node(node, POLL_S, lambda: poll(report))

        self.to_node(node, HOP_S, lambda: poll(report))

    # -- the collective --------------------------------------------------------------------------------
    def _average(self, node: SimNode, a: ev.Average) -> None:
        key = (node.stage, a.step, a.revision)
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = Round(node.stage, a.step, a.revision, set(a.weights), self.now)
            self.after(ROUND_TIMEOUT_S, lambda: self._settle(r, timeout=True))
        node.round_seen.add((a.step, a.revision))
        if self.on_average is not None:
            self.on_average(node, a)
        if r.outcome is not None:
            # It arrived after the round ended without it (it was hung): nobody waits for its parts.
            self._answer(node, HOP_S, lambda: ev.RoundFailed(a.step, a.revision, "the round ended without this replica"))
            return
        r.joined[node.peer] = tuple(a.tickets)
        self._settle(r)

    def _settle(self, r: Round, *, timeout: bool = False) -> None:
        if r.outcome is not None:
            return
        # A replica that left its stage (the coordinator moved it, or it rejoined elsewhere) has dropped the stage's
        # round: its peers find it gone at once (a refused probe), as they do a dead one.
        waiting = [p for p in r.participants if p not in r.joined and self.nodes[p].alive and not self.nodes[p].moved and not timeout]
        if waiting:
            return
        ok = [p for p in r.joined if self.nodes[p].alive and not self.nodes[p].moved and (timeout is False or self.nodes[p].live(self.now))]
        excluded = sorted(r.participants - set(ok))
        breakers = sorted(self.round_breakers & set(ok))
        if not ok:
            r.outcome = ("failed", (), excluded)
            return
        if breakers:
            r.outcome = ("failed", (), breakers)  # the breakers' fins end the round: the collective names them
        elif len(excluded) >= 2 and self.rng.random() < 0.5:
            r.outcome = ("failed", (), excluded)
        else:
            r.outcome = ("done", tuple(sorted(t for p in ok for t in r.joined[p])), excluded)
        kind, result, excl = r.outcome
        for p in ok:
            node = self.nodes[p]

            def tell(node: SimNode = node) -> None:
                node.survived.add((r.step, r.revision))
                if kind == "done":
                    node.result = result
                    self._feed(node, ev.RoundDone(r.step, r.revision, list(excl)))
                else:
                    self._feed(node, ev.RoundFailed(r.step, r.revision, f"replicas {excl} left out", tuple(p for p in excl if p != node.peer)))

            self.to_node(node, HOP_S, tell)

    def _fetch(self, node: SimNode, a: ev.Fetch) -> None:
        """A participant answers once its round finished (it waits for that), for up to ``try_s``."""
        give_up = self.now + a.try_s

        def look() -> None:
            r = self.rounds.get((node.stage, a.step, a.revision))
            if r is not None and r.outcome is not None and r.outcome[0] == "failed" and node.peer in r.participants:
                # Its own round failed, and so did the others' (the model gives every survivor one outcome): each
                # answers "left" at once (node/finished_rounds.py), so it asks for the redo without waiting.
                self._feed(node, ev.Fetched(a.step, a.revision, ok=False, reason="the round failed at every other participant"))
                return
            if r is not None and r.outcome is not None and r.outcome[0] == "done" and not r.outcome[2]:  # full averages only
                if any(self.nodes[p].live(self.now) for p in r.joined if p not in r.outcome[2]):
                    node.result = r.outcome[1]
                    self._feed(node, ev.Fetched(a.step, a.revision, ok=True))
                    return
            if self.now >= give_up:  # the averager keeps retrying the participants until the try ends
                self._feed(node, ev.Fetched(a.step, a.revision, ok=False, reason="no participant served the result"))
                return
            self.to_node(node, min(POLL_S, max(HOP_S, give_up - self.now)), look)

        self.to_node(node, HOP_S, look)

    # -- stage 0's tickets and the pipeline ------------------------------------------------------------
    def _drive(self, node: SimNode) -> None:
        lease = node.lease
        if lease is None or node.waiting is None:
            return
        step = node.waiting[0]
        lease.begin(step, [t for t in lease.started if node.core.accounting.holds(step, t)], self.now)
        self._drive_poll(node, step)

    def _drive_poll(self, node: SimNode, step: int) -> None:
        lease = node.lease
        assert lease is not None
        if node.waiting is None or node.waiting[0] != step or node.finishing:
            return
        has_next = any(n.live(self.now) for n in self.stage_nodes(1)) if self.S > 1 else True
        self._carry_lease(node, lease.poll(self.now, in_flight=node.core.accounting.num_in_flight, has_next_stage=has_next))
        self.to_node(node, min(0.1, max(0.01, lease.next_wake(self.now) - self.now)), lambda: self._drive_poll(node, step))

    def _carry_lease(self, node: SimNode, actions: list[lc.LeaseAction]) -> None:
        lease = node.lease
        assert lease is not None
        for a in actions:
            if isinstance(a, ev.Emit):
                node.events.append(f"{self.now:.2f} {a.event} {a.fields}")
            elif isinstance(a, lc.RequestLease):
                def ask(a: lc.RequestLease = a) -> None:
                    try:
                        reply = self.request(node.peer, cm.Lease(max_tickets=a.max_tickets))
                    except (Refusal, Unavailable) as err:
                        self._carry_lease(node, lease.handle(lc.LeaseFailed(str(err)), self.now))
                        return
                    assert isinstance(reply, cm.LeaseReply)
                    node.nonces.update(((reply.step, i), n) for i, n in zip(reply.indices, reply.nonces))
                    node.avoid = (reply.step, set(reply.avoid))
                    self._carry_lease(node, lease.handle(lc.Leased(reply.step, list(reply.indices)), self.now))

                self.to_node(node, HOP_S, ask)
            elif isinstance(a, lc.StartTicket):
                self._start_ticket(node, a.step, a.ticket)
            elif isinstance(a, lc.Release):
                def release(a: lc.Release = a) -> None:
                    try:
                        self.request(node.peer, cm.Release(step=a.step, indices=a.tickets))
                    except (Refusal, Unavailable):
                        pass  # the lease runs out instead

                self.to_node(node, HOP_S, release)
            elif isinstance(a, lc.ReportComplete):
                self._report(node, a)

    def _report(self, node: SimNode, a: lc.ReportComplete) -> None:
        lease = node.lease
        assert lease is not None

        def go() -> None:
            try:
                self.request(node.peer, cm.Complete(step=a.step, index=a.ticket, route=a.route, loss=a.loss, ack=a.ack,
                                                         nonce=a.nonce))
            except Unavailable:
                self.to_node(node, 1.0, go)  # the link retries for a while
                return
            except Refusal as err:
                self._carry_lease(node, lease.handle(lc.CompleteRefused(a.step, a.ticket, err.code, err.reason), self.now))

        self.to_node(node, HOP_S, go)

    def _start_ticket(self, node: SimNode, step: int, ticket: int) -> None:
        handed = node.handed.pop((step, ticket), None)
        if handed is not None and self.nodes[handed[0]].alive:
            lost_to, member_since = handed
            if member_since is not None and self._joined_at(lost_to) == member_since:
                # Restarted while the peer it went to is connected: its gradient is overdue (a dead peer's
                # closed connection restarts its tickets at once and counts as no loss, as node/driver.py does).
                self._lost(node, lost_to)
            else:
                # It left the swarm since (and maybe rejoined): the router forgot its losses, and the driver sent
                # the coordinator a departure notice (node/driver.py's peer_down, at the view change).
                node.lost.pop(lost_to, None)
                self._notice_departure(node, lost_to)
        d = node.core.accounting.admit_forward(step, ticket)
        if d.action != "process":
            self._not_started(node, step, ticket)
            return
        node.grads.get(step, set()).discard(ticket)
        if self.S == 1:
            node.grads.setdefault(step, set()).add(ticket)
            node.core.accounting.backward_done(step, ticket)
            self._gradient_home(node, step, ticket, [node.peer])
            return
        self._send_forward(node, step, ticket, [node.peer])

    def _not_started(self, node: SimNode, step: int, ticket: int) -> None:
        node.core.accounting.dropped(step, ticket)
        if node.lease is not None and node.stage == 0:
            self._carry_lease(node, node.lease.handle(lc.NotStarted(step, ticket), self.now))

    def _send_forward(self, node: SimNode, step: int, ticket: int, route: list[str]) -> None:
        stage = len(route)
        members = {m.peer_id for m in self.coord.registry.live()} if self.now >= self.down_until else set(self.nodes)
        candidates = [n for n in self.stage_nodes(stage) if n.peer in members and n.core.state.live]
        if not candidates:
            self._drop(node, step, ticket)
            return
        if stage == 1 and node.avoid[0] == step:  # the router's RouteCore.choose: sit-outs only when nobody else serves
            candidates = [n for n in candidates if n.peer not in node.avoid[1]] or candidates
        target = self.rng.choice(candidates)
        if not target.alive or target.moved:
            self._drop(node, step, ticket)  # the dial fails at once
            return
        if self.now < target.hung_until:
            self.to_node(node, SEND_TIMEOUT_S, lambda: self._drop(node, step, ticket))  # the send times out
            return
        if stage == 1:
            # A hand-over the peer acknowledged (as the real router records it), in the peer's current membership.
            node.handed[(step, ticket)] = (target.peer, self._joined_at(target.peer))
        if stage == 1 and node.lease is not None:  # stage 1 took it: the attempt is handed on (its ack)
            self._carry_lease(node, node.lease.handle(lc.Handed(step, ticket), self.now))
        self.to_node(target, HOP_S, lambda: self._forward_arrived(target, step, ticket, route, node.peer))

    def _joined_at(self, peer: str) -> float | None:
        m = self.coord.registry.members.get(peer)
        return m.joined_at if m is not None and m.status == "live" else None

    def _drop(self, node: SimNode, step: int, ticket: int) -> None:
        node.handed.pop((step, ticket), None)  # refused or never delivered: no hand-over, so no loss (RouteCore)
        if node.stage == 0:
            self._not_started(node, step, ticket)
        else:
            node.core.accounting.dropped(step, ticket)

    def _forward_arrived(self, node: SimNode, step: int, ticket: int, route: list[str], sender: str, *, admitted: bool = False) -> None:
        if not admitted:
            d = node.core.accounting.admit_forward(step, ticket, (step, ticket, route, sender))
            if d.action == "refuse":
                # A refusal is an answer, not a microbatch it acknowledged and lost (the real driver counts only those).
                self.nodes[sender].handed.pop((step, ticket), None)
                self._drop(self.nodes[sender], step, ticket)
                return
            if d.action == "defer":
                return
        route = route + [node.peer]
        node.grads.get(step, set()).discard(ticket)
        if len(route) == self.S:
            node.grads.setdefault(step, set()).add(ticket)
            node.core.accounting.backward_done(step, ticket)
            self._send_backward(node, step, ticket, route)
        else:
            self._send_forward(node, step, ticket, route)

    def _send_backward(self, node: SimNode, step: int, ticket: int, route: list[str]) -> None:
        prev = self.nodes[route[node.stage - 1]]

        def arrive() -> None:
            d = prev.core.accounting.admit_backward(step, ticket)
            if d.action != "process":
                return
            prev.grads.setdefault(step, set()).add(ticket)
            prev.core.accounting.backward_done(step, ticket)
            if prev.stage == 0:
                self._gradient_home(prev, step, ticket, route)
            else:
                self._send_backward(prev, step, ticket, route)

        self.to_node(prev, HOP_S, arrive)

    def _lost(self, node: SimNode, peer: str) -> None:
        """``peer`` lost one of ``node``'s microbatches: report it when the real driver would
        (:func:`~protolearn.protocol.lost_reports.should_report`)."""
        n = node.lost[peer] = node.lost.get(peer, 0) + 1
        if not should_report(n, node.reported_at.get(peer), self.now):
            return
        node.reported_at[peer] = (self.now, n)

        def report() -> None:
            try:
                self.request(node.peer, cm.Report(target=peer, reason=f"liveness: {n} microbatches it acknowledged got no gradient back", lost=n))
            except (Refusal, Unavailable):
                pass

        self.to_node(node, HOP_S, report)

    def _notice_departure(self, node: SimNode, peer: str) -> None:
        if not should_notice_departure(node.reported_at.get(peer), self.now):
            return
        node.reported_at[peer] = (self.now, 0)

        def report() -> None:
            try:
                self.request(node.peer, cm.Report(target=peer, reason="liveness: it left holding microbatches it acknowledged", lost=0))
            except (Refusal, Unavailable):
                pass

        self.to_node(node, HOP_S, report)

    def _gradient_home(self, node: SimNode, step: int, ticket: int, route: list[str]) -> None:
        assert node.lease is not None
        if node.handed.pop((step, ticket), None) is not None and len(route) > 1:
            node.lost.pop(route[1], None)  # it sent a gradient back: its losses are not in a row
        # The last stage's acknowledgement of the route and loss, as the real router's rides back.
        nonce = node.nonces.get((step, ticket), b"")
        ack = None if len(route) == 1 else _sim_sign(route[-1], ack_statement(self.run.run_hash, step, ticket, route, 1.0, nonce))
        self._carry_lease(node, node.lease.handle(lc.Completed(step, ticket, route, 1.0, ack, nonce), self.now))


def _hash(params: list[tuple[int, ...]]) -> str:
    import hashlib

    return hashlib.sha256(repr(params).encode()).hexdigest()
