"""The node core: every decision a replica takes about a closed step, as a sans-IO state machine.

:class:`NodeCore` holds the facts a replica's decisions rest on: its :class:`NodeState`, the number
of optimizer steps it has applied (the one owner of that number: the accounting, the collective's
round window and the checkpoints read it from here), and, while a step is being finished, where it
stands. It never does IO and never reads a clock: the adapter (:mod:`protolearn.node.node`) feeds it
events with ``now`` and carries out the actions it returns, and the unit tests and the simulator do
the same with a fake clock. Each action that asks something (a round, a redo, the commit) is answered
by exactly one event; the core takes one question at a time, so a step's decisions read top to
bottom.

Finishing step t once the coordinator closed it at revision r (its frozen accounting names, for this
stage, which peer accounts for which tickets):

1. A **participant** (the accounting lists it) sums exactly its accounted tickets. If it lacks some
   (it restarted after the step closed), and a replica already applied the step, it resyncs; else it
   asks for those tickets to be redone. Then it runs the stage's collective round.
2. A replica the accounting **left out** fetches the round's result from a participant. While that
   fails it asks whether the step reopened, and, once every participant is gone, to redo the step. A
   participant that no longer keeps the round moved past it: if the step reopened meanwhile the replica
   waits for its next closing, else (the step committed) it resyncs.
3. **The round** leaves out replicas that died (their tickets are redone, the step reopens and closes
   at r+1) or fails outright. A replica whose round failed first asks the other participants for the
   round's result: if they finished it, it takes their full average, proven by a strict majority of the
   participants' signed fins (a liar that failed only this replica's round gains nothing); otherwise it
   asks for the whole step to be redone, naming the round's causes (``round_failed``: the coordinator
   charges the redo to them once a majority of the stage's participants name them). No replica applies a
   sum that misses a ticket unless the coordinator refused the redo, which is logged as ``tickets_lost``.
4. **The commit barrier.** Every replica waits until every stage has averaged t at r. If the step
   reopened meanwhile, it waits for it to close again; otherwise it applies the identical update. If the
   coordinator refused its result (its stage's majority holds another hash), it resyncs instead.
5. **A step that committed without this replica** (the coordinator refuses its redo with
   ``step_committed``: it counted this replica as gone, e.g. its connection dropped, and the stage's other
   replicas committed alone): if a live replica of the stage reports having applied it, this one resyncs
   from it. If none does, asked again a few heartbeats apart, every replica that held the result died
   right after the commit, and no replica can finish the step any more: redoing it is refused, its
   result is nowhere, and a resync would only return the same state, one step behind, forever. Then
   this stage's update of that step is lost: the replica counts it applied with no update
   (:class:`Skip`, loud ``step_lost``), as a checkpoint older than the swarm's step does
   (:mod:`protolearn.node.persistence`), and trains on. Every survivor of the stage decides the same
   from the same answers, so they stay identical (I2).
6. A refused redo is followed by the question "did the step reopen anyway?" (another replica may have
   asked first). A coordinator error is not an answer: the question is asked again, for a bounded
   time, and only then does the replica fall back to the safe choice (a resync, which never applies
   anything of its own). Every refusal is handled alike, whatever its code: the coordinator's bounds on
   redo (``revision_cap``: the step reopened ``max_revisions`` times and its last revision stands;
   ``redo_limit``: this peer had its share of redos this step) lead to the same fallback.

Why replicas take the same decisions (I1, I2): every branch above is a function of the frozen
accounting, the round's outcome (which the collective makes identical on every survivor) and the
coordinator's answers, which are one ledger's. So survivors of a stage either all apply the same sum
of the same B tickets or all wait for revision r+1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import Enum

from protolearn.node.core.accounting import Accounting, contribution
from protolearn.node.core.events import (
    Action,
    Applied,
    Apply,
    AskReopened,
    AskReported,
    Average,
    Closed,
    CommitAnswer,
    Emit,
    Event,
    Fetch,
    Fetched,
    Redo,
    RedoAnswer,
    ReopenAnswer,
    Reported,
    Resync,
    RoundDone,
    RoundFailed,
    Skip,
    StartHeld,
    Synced,
    WaitClosed,
    WaitCommit,
)
from protolearn.protocol.rounds import REVISIONS_PER_STEP, round_id
from protolearn.protocol.states import NodeState

# A replica the accounting left out asks the participants for the step's result this long (at least: the
# adapter gives a vector that its measured link needs longer for that long, node/finishing.py) before it
# checks whether the step reopened, or whether every participant is gone and the step must be redone.
FETCH_TRY_S = 3.0
# A coordinator error while asking whether the step reopened: ask again after this long.
ASK_AGAIN_S = 1.0
# A step committed without this replica: ask this many times, this far apart (a replica that just applied
# it reports that with its next heartbeat), whether a live replica holds it, before counting it lost.
HOLDER_CHECKS = 3
HOLDER_CHECK_S = 1.0


class Phase(Enum):
    IDLE = "idle"
    ASK_REPORTED = "ask_reported"
    AVERAGING = "averaging"
    FETCHING = "fetching"
    REDOING = "redoing"
    ASK_REOPENED = "ask_reopened"
    COMMITTING = "committing"
    APPLYING = "applying"
    RESYNCING = "resyncing"
    OUTER = "outer"  # DiLoCo: applied an outer round's last inner step, syncing with the stage (inner_step.py)


# What a replica does when a redo was refused and the step did not reopen.
class Fallback(Enum):
    RESYNC = "resync"  # take a live replica's state: never apply a sum that misses tickets
    LOST = "lost"  # the round already left a dead replica out: apply, and say which tickets are lost
    FETCH = "fetch"  # a left-out replica: keep asking the participants for the result


@dataclass(frozen=True)
class CoreConfig:
    microbatches_per_step: int
    max_in_flight: int
    max_deferred: int
    # How long a left-out replica keeps trying to get the result, and a reopen question is retried.
    averaging_timeout_s: float


class NodeCore:
    """One replica's decisions. Feed :meth:`handle` events; carry out the actions it returns."""

    def __init__(self, me: str, stage: int, config: CoreConfig, *, applied: int = 0) -> None:
        self.me = me
        self.stage = stage
        self.config = config
        self.state = NodeState.SYNCING
        # Admission of microbatch work; it also holds the applied-step count (see :attr:`applied`).
        self.accounting = Accounting(config.microbatches_per_step, config.max_in_flight, config.max_deferred, applied=applied)
        self.phase = Phase.IDLE
        self._next_round = round_id(applied)
        self._step = -1
        self._revision = 0
        self._account: dict[str, list[int]] = {}
        self._all: list[int] | None = None  # the account's tickets, sorted (_tickets)
        self._loss: float | None = None
        self._summed: list[int] = []
        self._counted: list[int] | None = None
        self._fallback = Fallback.RESYNC
        self._deadline = 0.0
        self._started_at = 0.0
        self._missing: list[int] = []
        self._lost: tuple[list[int], list[str]] = ([], [])
        # This participant's round failed: it first takes the others' result, if they finished (see point 3).
        self._failed: RoundFailed | None = None
        self._redo_all_next = False
        self._last_redo = Redo(-1, 0, [], "")
        # The step committed without this replica: how many times it asked whether a live replica holds it.
        self._holder_checks = 0

    # -- facts -------------------------------------------------------------------------------------
    @property
    def applied(self) -> int:
        """Optimizer steps this replica has applied; it trains step ``applied`` next."""
        return self.accounting.applied

    @property
    def next_round(self) -> int:
        """The collective round this replica takes part in next (parts for it may arrive early).

        While a step is finished but not committed, it may reopen: its next round is revision + 1.
        """
        return self._next_round

    def _window(self, step: int, revision: int) -> None:
        self._next_round = round_id(step, min(revision, REVISIONS_PER_STEP))

    @property
    def participant(self) -> bool:
        return self.me in self._account

    def all_tickets(self) -> list[int]:
        """The tickets the stage's account holds, sorted (a new list)."""
        return list(self._tickets())

    def _tickets(self) -> list[int]:
        # Worked out once per close (or given by the close): every replica of a stage needs the same B tickets.
        if self._all is None:
            self._all = sorted({t for ts in self._account.values() for t in ts})
        return self._all

    # -- events ------------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        """Take one event at ``now``; returns what to do next (questions are answered by one event each)."""
        if isinstance(event, Synced):
            return self._synced(event)
        if isinstance(event, Closed):
            return self._closed(event, now)
        if event.step != self._step:
            return [Emit("ignored", {"step": event.step, "expected": self._step}, logging.WARNING,
                         f"dropped {type(event).__name__} of step {event.step}: finishing step {self._step}")]
        if isinstance(event, Reported):
            return self._reported(event)
        if isinstance(event, RoundDone):
            return self._round_done(event)
        if isinstance(event, RoundFailed):
            self._expect(Phase.AVERAGING, event)
            self._failed = event
            return [Emit("averaging_failed", {"step": self._step, "reason": event.reason, "causes": list(event.causes)}), *self._fetch()]
        if isinstance(event, Fetched):
            return self._fetched(event, now)
        if isinstance(event, RedoAnswer):
            return self._redo_answer(event, now)
        if isinstance(event, ReopenAnswer):
            return self._reopen_answer(event, now)
        if isinstance(event, CommitAnswer):
            return self._commit_answer(event)
        if isinstance(event, Applied):
            return self._applied(event, now)
        raise TypeError(f"not a node core event: {event!r}")

    def _expect(self, phase: Phase, event: object) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"{type(event).__name__} in phase {self.phase.value}, expected {phase.value}")

    def _synced(self, event: Synced) -> list[Action]:
        self.accounting.reset(event.applied)
        self.phase = Phase.IDLE
        self._window(event.applied, 1)
        self.state = NodeState.TRAINING
        return []

    def start_syncing(self) -> None:
        """The replica is about to take another state (a build, a move, a resync)."""
        self.state = NodeState.SYNCING

    def leaving(self) -> None:
        self.state = NodeState.LEAVING

    def _closed(self, event: Closed, now: float) -> list[Action]:
        if self.phase is not Phase.IDLE:
            raise RuntimeError(f"step {event.step} closed while finishing step {self._step} ({self.phase.value})")
        if event.step != self.applied:
            return [Emit("ignored", {"step": event.step, "applied": self.applied}, logging.WARNING,
                         f"step {event.step} closed, but this replica trains step {self.applied}")]
        self._step, self._revision, self._loss = event.step, event.revision, event.loss
        # The lists as given, sorted by their producer (events.Closed), and never changed here: a replica of a
        # stage with R replicas copying and sorting R lists at each close made a close O(R) list builds per replica.
        self._account = dict(event.account)
        self._all = event.tickets
        self._counted, self._started_at, self._failed = None, now, None
        self._holder_checks = 0
        self.state = NodeState.AVERAGING
        if not self._account:
            return self._resync(f"step {event.step} closed without an accounting for stage {self.stage}")
        if event.revision > REVISIONS_PER_STEP:
            return self._resync(f"step {event.step} reached revision {event.revision}; at most {REVISIONS_PER_STEP} are averaged")
        self._window(event.step, event.revision)
        if not self.participant:
            self._deadline = now + self.config.averaging_timeout_s
            return self._fetch()
        summed, missing, dropped = contribution(self._account[self.me], event.held)
        self._summed = summed
        out: list[Action] = []
        if dropped:
            # Completion refused or route broken after this stage: another attempt counts these.
            out.append(Emit("tickets_not_counted", {"step": event.step, "tickets": dropped}))
        if missing:
            # E.g. this peer restarted after the step closed: its earlier life computed these tickets.
            self.phase = Phase.ASK_REPORTED
            self._missing = missing
            return out + [AskReported(event.step)]
        return out + self._average()

    def _weights(self) -> dict[str, float]:
        return {p: float(len(ts)) for p, ts in self._account.items()}

    def _average(self) -> list[Action]:
        self.phase = Phase.AVERAGING
        return [Average(self._step, self._revision, round_id(self._step, self._revision), self._weights(), self._summed)]

    def _fetch(self) -> list[Action]:
        self.phase = Phase.FETCHING
        return [Fetch(self._step, self._revision, round_id(self._step, self._revision), self._weights(), FETCH_TRY_S)]

    def _reported(self, event: Reported) -> list[Action]:
        self._expect(Phase.ASK_REPORTED, event)
        if self._holder_checks:
            return self._holders_answer(event)
        missing = self._missing
        if event.applied_elsewhere:
            return self._resync(f"step {self._step}: accounted tickets {missing} have no gradients here; a replica applied the step")
        return [Emit("missing_tickets", {"step": self._step, "tickets": missing}, logging.ERROR,
                     f"step {self._step}: accounted tickets {missing} have no gradients here; asking to redo them"),
                *self._redo(missing, "replica lost the tickets' gradients", Fallback.RESYNC, kind="lost_gradients")]

    def _round_done(self, event: RoundDone) -> list[Action]:
        self._expect(Phase.AVERAGING, event)
        excluded = sorted(event.excluded)
        if excluded:
            counted = [t for p, ts in self._account.items() if p not in excluded for t in ts]
            counted.sort()
        else:  # the usual case: every ticket, one list per close (sorting all B tickets on each replica was 5% of a
            counted = self._tickets()  # 10,000-node simulation)
        self._counted = counted
        if excluded:
            lost = sorted({t for p in excluded for t in self._account.get(p, [])})
            out: list[Action] = [Emit("replica_out", {"step": self._step, "excluded": excluded, "tickets": lost})]
            if lost:
                self._lost = (lost, excluded)
                return out + self._redo(lost, f"replicas {excluded} of stage {self.stage} died during averaging", Fallback.LOST,
                                        kind="replica_out")
            return out + self._commit()
        return self._commit()

    def _fetched(self, event: Fetched, now: float) -> list[Action]:
        self._expect(Phase.FETCHING, event)
        failed, self._failed = self._failed, None
        if failed is not None:
            # This participant's own round failed: the others' proven full result has every ticket in; else redo.
            if event.ok:
                self._counted = self.all_tickets()
                return [Emit("result_taken", {"step": self._step, "revision": self._revision}), *self._commit()]
            return self._redo(self.all_tickets(), f"stage {self.stage} averaging failed: {failed.reason}", Fallback.RESYNC,
                              kind="round_failed", causes=failed.causes)
        if event.ok:
            return self._commit()
        if event.gone:
            # The participant moved past this round: either the step reopened meanwhile (this replica follows
            # its later closing, as every replica does) or it committed (then a resync is the only way on).
            self.phase = Phase.ASK_REOPENED
            self._fallback = Fallback.RESYNC
            return [AskReopened(self._step, self._revision)]
        # A participant died and its tickets are being redone, or every participant is gone: ask.
        self.phase = Phase.ASK_REOPENED
        self._fallback = Fallback.FETCH
        self._redo_all_next = True
        return [AskReopened(self._step, self._revision)]

    def _redo(
        self, tickets: list[int], reason: str, fallback: Fallback, *, expected: bool = False, kind: str = "", causes: tuple[str, ...] = (),
    ) -> list[Action]:
        self.phase = Phase.REDOING
        self._window(self._step, self._revision + 1)
        self._fallback = fallback
        self._redo_all_next = False
        self._last_redo = Redo(self._step, self._revision, tickets, reason, expected, kind=kind, causes=tuple(causes))
        return [self._last_redo]

    def _redo_answer(self, event: RedoAnswer, now: float) -> list[Action]:
        self._expect(Phase.REDOING, event)
        if event.granted:
            return self._reopened()
        if event.code == "step_committed":
            # Committed without this replica's result: does a live replica hold it? (Point 5 above.)
            self.phase = Phase.ASK_REPORTED
            self._holder_checks = 1
            return [AskReported(self._step)]
        if event.granted is None:
            # Unanswered is not refused: a refusal taken from a restarting coordinator would apply a sum
            # that misses the tickets. Ask again while the step may still be finished in time.
            if now < self._started_at + self.config.averaging_timeout_s:
                return [Emit("coordinator_unanswered", {"step": self._step, "reason": event.reason}, logging.WARNING,
                             f"step {self._step}: the redo got no answer ({event.reason}); asking again"),
                        replace(self._last_redo, delay_s=ASK_AGAIN_S)]
            return self._resync(f"step {self._step}: the coordinator did not answer the redo within "
                                f"{self.config.averaging_timeout_s:g} s ({event.reason})")
        # Another replica of the stage may have reopened the step first: then it closes again anyway.
        self.phase = Phase.ASK_REOPENED
        return [AskReopened(self._step, self._revision)]

    def _reopen_answer(self, event: ReopenAnswer, now: float) -> list[Action]:
        self._expect(Phase.ASK_REOPENED, event)
        if event.reopened:
            return self._reopened()
        if event.reopened is None:
            # No answer is not "no": a wrong "no" would apply or resync a step that is being redone.
            if now < self._started_at + self.config.averaging_timeout_s:
                return [Emit("coordinator_unanswered", {"step": self._step, "reason": event.reason}, logging.WARNING,
                             f"step {self._step}: could not ask the coordinator whether the step reopened ({event.reason}); asking again"),
                        AskReopened(self._step, self._revision, ASK_AGAIN_S)]
            return self._resync(f"step {self._step}: the coordinator did not say whether the step reopened within "
                                f"{self.config.averaging_timeout_s:g} s ({event.reason})")
        if self._fallback is Fallback.FETCH:
            if self._redo_all_next:
                # Granted only once every participant of the stage is gone: nobody holds its gradients.
                return self._redo(self.all_tickets(), f"all replicas of stage {self.stage} that averaged the step are gone",
                                  Fallback.FETCH, expected=True, kind="orphaned")
            if now > self._deadline:
                return self._resync(f"step {self._step}: no participant of stage {self.stage} served the result")
            return self._fetch()
        if self._fallback is Fallback.LOST:
            lost, excluded = self._lost
            return [Emit("tickets_lost", {"step": self._step, "tickets": lost, "excluded": excluded}, logging.ERROR,
                         f"step {self._step} applied without tickets {lost} of dead replicas {excluded}: the coordinator refused to redo them"),
                    *self._commit()]
        return self._resync(f"step {self._step}: the coordinator refused the redo and the step did not reopen")

    def _holders_answer(self, event: Reported) -> list[Action]:
        if event.applied_elsewhere:
            return self._resync(f"step {self._step} committed without this replica; a replica that applied it holds the stage's state")
        if self._holder_checks < HOLDER_CHECKS:
            self._holder_checks += 1
            return [AskReported(self._step, HOLDER_CHECK_S)]
        why = (f"step {self._step} committed, but no live replica of stage {self.stage} holds its result (the replicas that "
               f"applied it are gone): this stage's update of step {self._step} is lost; continuing at step {self._step + 1}")
        self.phase = Phase.APPLYING
        return [Emit("step_lost", {"step": self._step, "revision": self._revision}, logging.ERROR, why),
                Skip(self._step, self._revision, why)]

    def _reopened(self) -> list[Action]:
        self.phase = Phase.IDLE
        self._window(self._step, self._revision + 1)
        return [WaitClosed(self._step, self._revision + 1)]

    def _commit(self) -> list[Action]:
        # A participant reports that its stage averaged the step; a left-out replica that it fetched the
        # result. The step commits only once every live replica holds the result (see the ledger).
        self.phase = Phase.COMMITTING
        self._window(self._step, self._revision + 1)
        return [WaitCommit(self._step, self._revision, report=True)]

    def _commit_answer(self, event: CommitAnswer) -> list[Action]:
        self._expect(Phase.COMMITTING, event)
        if event.refused:
            return self._resync(f"step {self._step}: the coordinator refused this replica's result: {event.refused}")
        if not event.committed:
            return [Emit("reopened", {"step": self._step, "revision": self._revision}), *self._reopened()]
        self.phase = Phase.APPLYING
        return [Apply(self._step, self._revision, self._loss, self._account.get(self.me, []), sorted(self._account), self._counted)]

    def _applied(self, event: Applied, now: float) -> list[Action]:
        self._expect(Phase.APPLYING, event)
        held = self.accounting.applied_step(event.step)
        self.phase = Phase.IDLE
        self._window(event.step + 1, 1)
        self.state = NodeState.TRAINING
        return [StartHeld(held)] if held else []

    def _resync(self, reason: str) -> list[Action]:
        self.phase = Phase.RESYNCING
        self.state = NodeState.SYNCING
        return [Emit("resync", {"step": self._step, "reason": reason}, logging.WARNING, reason), Resync(self._step, reason)]

    def averaging_seconds(self, now: float) -> float:
        return now - self._started_at
