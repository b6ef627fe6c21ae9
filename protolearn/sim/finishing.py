"""Finishing a closed step in the simulation: the real :class:`~protolearn.node.core.closed_step.NodeCore` of each
node, fed its events and with its actions carried out, as ``node/node.py`` and ``node/finishing.py`` do.

- **The close.** A node's train loop long-polls the step it trains; when the coordinator closes it (the
  host announces it) every node waiting for that step gets the close one link delay later, asks the
  real core for the step's info (``step_info``, as the service answers ``WaitStep``) and feeds its core
  :class:`Closed` with its stage's frozen accounting and the tickets its accounting holds.
- **The core's questions** go to the real coordinator core (a redo, whether the step reopened, the
  commit report), to :mod:`.rounds` (a round, a fetch), or to the other replicas (whether one applied
  the step), each answered by one event after the node's round trip.
- **The commit** is a long poll as well: a participant reports ``Averaged`` with its round's result hash
  and waits until the step commits (:class:`CommitAnswer` true) or reopens (false).
- **Apply** counts the step applied (its result hash is the round's), releases work held for the next
  step (``StartHeld``) and starts the next step; a resync hands the node back to :mod:`.membership`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from protolearn.coordinator.errors import Refusal
from protolearn.node.core import events as ev
from protolearn.protocol import coordination as cm
from protolearn.sim.coordinator_host import Unavailable
from protolearn.sim.world import SimNode, World

RETRY_S = 1.0  # the link retries a request the coordinator could not take


def result_hash(stage: int, step: int, revision: int, excluded: list[str]) -> str:
    """The hash a stage's survivors report for a round: the same for every survivor of it (as the real collective's)."""
    return hashlib.sha256(f"{stage}/{step}/{revision}/{','.join(sorted(excluded))}".encode()).hexdigest()


class Finisher:
    """Carries out every node core's actions; listens to the coordinator's closes, reopens and commits."""

    def __init__(
        self, world: World, *, join_round: Callable[[SimNode, ev.Average], None], fetch: Callable[[SimNode, ev.Fetch], None],
        drive: Callable[[SimNode, int], None], start_held: Callable[[SimNode, list], None], resync: Callable[[SimNode, str], None],
        applied: Callable[[SimNode, int], None],
    ) -> None:
        self.w = world
        self.join_round = join_round
        self.fetch = fetch
        self.drive = drive
        self.start_held = start_held
        self.resync = resync
        self.applied = applied
        # Nodes whose train loop waits for a step to close, and nodes waiting for a step to commit.
        # An insertion-ordered set per step (a set of nodes iterates in id() order, which differs run to run).
        self._close_waiters: dict[int, dict[SimNode, None]] = {}
        self._commit_waiters: dict[int, dict[SimNode, int]] = {}
        # Each stage's frozen accounting of (step, revision), built once and shared by its replicas.
        # (step, revision) → stage → (its account, its tickets sorted): worked out once for all its replicas.
        self._accounts: dict[tuple[int, int], dict[int, tuple[dict[str, list[int]], list[int]]]] = {}
        # The result hash each node's round gave it (a fetched result included), per (step, revision).
        self.results: dict[SimNode, str] = {}

    # -- the train loop --------------------------------------------------------------------------------
    def train(self, node: SimNode) -> None:
        """Train the step after the last applied one: drive it (stage 0) and wait for it to close."""
        assert node.core is not None
        self._wait_closed(node, node.core.applied, 1)

    def _wait_closed(self, node: SimNode, step: int, revision: int) -> None:
        node.waiting, node.finishing = (step, revision), False
        self._close_waiters.setdefault(step, {})[node] = None
        self.drive(node, step)
        closed = self.w.host.core.ledger.closed.get(step) if self.w.host.up else None
        if closed is not None and closed.revision >= revision and step < self.w.host.core.ledger.step:
            self.w.engine.after(node.wire.delay_s, self._closed, node, step, node.epoch)

    def on_closed(self, step: int, revision: int) -> None:
        for node in list(self._close_waiters.get(step, ())):
            if node.waiting is not None and node.waiting[0] == step and node.waiting[1] <= revision:
                self.w.engine.after(node.wire.delay_s, self._closed, node, step, node.epoch)

    def _closed(self, node: SimNode, step: int, epoch: int) -> None:
        if not node.alive or node.silent or epoch != node.epoch or node.waiting is None or node.waiting[0] != step or node.finishing:
            return
        info = self.w.host.step_info(step, node.waiting[1])
        if info is None or not info.closed:
            return  # a later close will call again
        assert node.core is not None
        self._close_waiters.get(step, {}).pop(node, None)
        node.waiting, node.finishing = None, True
        account, tickets = self._account(info).get(node.stage, ({}, []))
        self.feed(node, ev.Closed(step, info.revision, account, info.loss, node.core.accounting.accumulated(step), tickets))

    def _account(self, info: cm.StepInfo) -> dict[int, tuple[dict[str, list[int]], list[int]]]:
        key = (info.step, info.revision)
        got = self._accounts.get(key)
        if got is None:
            # Sorted once here for every replica that closes this revision (events.Closed).
            got = self._accounts[key] = {}
            for sa in info.accounting:
                account = {pt.peer_id: sorted(pt.tickets) for pt in sa.peers}
                got[sa.stage] = (account, sorted({t for ts in account.values() for t in ts}))
            for old in [k for k in self._accounts if k[0] < info.step - 2]:
                del self._accounts[old]
        return got

    def forget(self, node: SimNode) -> None:
        """The node dropped what it was doing (a resync, a move, its death)."""
        for waiters in self._close_waiters.values():
            waiters.pop(node, None)
        for waiters in self._commit_waiters.values():
            waiters.pop(node, None)
        self.results.pop(node, None)

    # -- the core ----------------------------------------------------------------------------------------
    def feed(self, node: SimNode, event: ev.Event) -> None:
        if not node.alive or node.silent or node.core is None:
            return
        for a in node.core.handle(event, self.w.now):
            self._carry(node, a)

    def _later(self, node: SimNode, delay: float, make: Callable[[], ev.Event | None]) -> None:
        epoch = node.epoch

        def go() -> None:
            if node.epoch == epoch and node.alive and not node.silent:
                got = make()
                if got is not None:
                    self.feed(node, got)

        self.w.engine.after(delay, go)

    def _carry(self, node: SimNode, a: ev.Action) -> None:
        w = self.w
        rtt = 2.0 * node.wire.delay_s
        if isinstance(a, ev.Emit):
            w.metrics.events[a.event] += 1
        elif isinstance(a, ev.Average):
            self.join_round(node, a)
        elif isinstance(a, ev.Fetch):
            self.fetch(node, a)
        elif isinstance(a, ev.AskReported):
            self._later(node, a.delay_s + rtt, lambda: ev.Reported(a.step, self._applied_elsewhere(node, a.step)))
        elif isinstance(a, ev.Redo):
            self._later(node, a.delay_s + rtt, lambda: self._redo(node, a))
        elif isinstance(a, ev.AskReopened):
            self._later(node, a.delay_s + rtt, lambda: self._reopened(a))
        elif isinstance(a, ev.WaitCommit):
            self._later(node, rtt, lambda: self._report(node, a))
        elif isinstance(a, (ev.Apply, ev.Skip)):
            self._apply(node, a)
        elif isinstance(a, ev.Resync):
            self.resync(node, a.reason)
        elif isinstance(a, ev.StartHeld):
            self.start_held(node, list(a.payloads))
        elif isinstance(a, ev.WaitClosed):
            self._wait_closed(node, a.step, a.revision)
        else:
            raise TypeError(f"unexpected node core action {a!r}")

    def _applied_elsewhere(self, node: SimNode, step: int) -> bool:
        return any(
            (o := self.w.nodes[p]) is not node and o.serving and o.core is not None and o.core.applied > step for p in self.w.serving[node.stage]
        )

    def _redo(self, node: SimNode, a: ev.Redo) -> ev.Event:
        try:
            self.w.host.request(node.peer, cm.Redo(step=a.step, indices=a.tickets, reason=a.reason[:100], revision=a.revision,
                                                   kind=a.kind, causes=list(a.causes)))  # type: ignore[arg-type]
        except Refusal as err:
            self.w.metrics.events[f"redo_refused_{err.code or 'other'}"] += 1
            return ev.RedoAnswer(a.step, a.revision, granted=False, reason=str(err), code=err.code)
        except Unavailable as err:
            return ev.RedoAnswer(a.step, a.revision, granted=None, reason=str(err))
        self.w.metrics.events[f"redo_{a.kind or 'other'}"] += 1
        self.w.metrics.step(a.step).redone_tickets += len(a.tickets)
        return ev.RedoAnswer(a.step, a.revision, granted=True)

    def _reopened(self, a: ev.AskReopened) -> ev.Event:
        info = self.w.host.step_info(a.step, a.revision + 1)
        if info is None:
            return ev.ReopenAnswer(a.step, a.revision, reopened=None, reason="the coordinator is restarting")
        return ev.ReopenAnswer(a.step, a.revision, reopened=info.closed or info.open_step == a.step)

    # -- the commit ----------------------------------------------------------------------------------------
    def _report(self, node: SimNode, a: ev.WaitCommit) -> ev.Event | None:
        info: cm.StepInfo | None = None
        if a.report:
            held = self.results.get(node, "")
            try:
                info = self.w.host.request(node.peer, cm.Averaged(step=a.step, revision=a.revision, result_hash=held))  # type: ignore[assignment]
            except Unavailable:
                self._later(node, RETRY_S, lambda: self._report(node, a))
                return None
            except Refusal as err:
                if err.code == "result_mismatch":
                    return ev.CommitAnswer(a.step, a.revision, False, refused=err.reason)
                if err.code in ("stale_revision", "step_not_closed"):
                    return ev.CommitAnswer(a.step, a.revision, False)
                self._later(node, RETRY_S, lambda: self._report(node, a))
                return None
        if info is None:
            info = self.w.host.step_info(a.step, a.revision)
            if info is None:
                self._later(node, RETRY_S, lambda: self._report(node, ev.WaitCommit(a.step, a.revision, report=False)))
                return None
        if info.committed and info.revision == a.revision:
            return ev.CommitAnswer(a.step, a.revision, True)
        if not info.closed or info.revision != a.revision:
            return ev.CommitAnswer(a.step, a.revision, False)
        self._commit_waiters.setdefault(a.step, {})[node] = a.revision
        return None

    def on_committed(self, step: int) -> None:
        for s in [s for s in self._commit_waiters if s <= step]:
            for node, revision in self._commit_waiters.pop(s).items():
                self._later(node, node.wire.delay_s, lambda n=node, s=s, r=revision: self._commit_answer(n, s, r))

    def _commit_answer(self, node: SimNode, step: int, revision: int) -> ev.Event:
        info = self.w.host.step_info(step, revision)
        ok = info is not None and info.committed and info.revision == revision
        return ev.CommitAnswer(step, revision, ok)

    def on_reopened(self, step: int) -> None:
        for node, revision in self._commit_waiters.pop(step, {}).items():
            self._later(node, node.wire.delay_s, lambda n=node, r=revision: ev.CommitAnswer(step, r, False))

    def _apply(self, node: SimNode, a: ev.Apply | ev.Skip) -> None:
        assert node.core is not None
        if isinstance(a, ev.Skip):
            self.w.metrics.events["step_skipped"] += 1
        held = self.results.pop(node, "")
        self.feed(node, ev.Applied(a.step, held))
        node.finishing = False
        self.applied(node, a.step)
        if node.alive and not node.silent and node.core.state.live:
            self.train(node)
