"""Who holds the commit up, and what that costs them (sans-IO): no single replica stalls the swarm.

The commit barrier (``commit.py``) waits for every live serving replica of each stage to report the
result it holds. A replica that never reports (its device hung, or it answers probes and sends nothing)
would hold every later step with it, for as long as its heartbeats keep it live. :class:`Holdups` bounds
that on the coordinator's own clock, from what the coordinator saw itself (a report that did not come),
never on a peer's word:

- a **holdout** of a stage is a live replica that has not reported while the others hold one result:
  every other live replica of its stage reported it, or a strict majority of them did
  (:meth:`~.commit.CommitBarrier.holdouts`); the time it has been one counts from when the coordinator
  first saw it so;
- once a holdout has held the commit for its **grace** (``commit_grace_s``, or 3 × the median of the
  recent steps' close-to-commit times if that is longer, so a swarm on slow links gets a longer one), the
  barrier stops waiting for it (:meth:`~.commit.CommitBarrier.excuse`): the step commits if the others
  are a strict majority of the stage's live replicas (a 2-replica stage still needs both, or the
  holdout's expulsion); the excused replica, if it comes back, reports the committed hash or resyncs;
- a stage-0 replica struck for late leases of the step (``leases.py``: it sat on them, completing
  nothing) that processed no ticket of it is excused at once: the coordinator saw it not working, and
  it holds nothing of the step;
- a stage none of whose replicas reported while every other stage's all did: its participants are its
  holdouts (the replicas the accounting left out can only fetch from them). Once excused, they no
  longer count as holding the stage's part of the step (:meth:`Holdups.silent`), so a left-out replica
  may redo the whole step (``redo.py``'s orphaned rule) rather than resync for ever;
- a replica excused on one step that has not reported since holds nothing of the next ones either: on
  each later step it is excused at once (if it processed no ticket of it), while its hold goes on;
- when the step closes again after a redo reopened it, every hold restarts its grace (keeping its strikes):
  the replicas average the step anew, and that delay is the reopener's cost, not theirs (reopenings are
  bounded per step, so this delays a real holdout's strikes by a bounded time); likewise the holds of a
  stage one of whose participants departed (left, expired, was banned, lost its connection) while the step
  waits: its stage-mates' round waits on it until they hold it out, and that wait is the departed one's;
- every grace it holds is a strike (flag ``commit_hold``), whatever anyone else is doing (no other
  replica need be leasing), and ``expel_after_strikes`` of them with no report in between ban it
  (``liveness: held the commit ...``). A report clears the count. On a step whose round in its stage had
  a participant the coordinator banned, twice as many: the survivors wait out that round without the
  banned peer, and the delay is its cost, not theirs (under load, an honest replica was once expelled
  after 12 s of such a round, when the liar of its stage was convicted mid-round).

Why a liar cannot use this against an honest replica: the clock starts only when every other live
replica of the stage, or a strict majority of them, reported one hash; with honest replicas in the
majority that includes an honest one holding the result the collective gave them, and an honest replica
is struck only if it lags that by a grace. In a stage of two, one liar can start the clock on its honest partner; such a stage has
no honest majority and halts either way (``commit.py``).

:attr:`Holdups.waiting` names, for ``swarm status``, the stage and replica the commit waits on and for
how long.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.steps import ClosedStep
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.core.verdicts import VerdictPolicy

# Close-to-commit times kept for the grace's median.
RECENT = 32


@dataclass(frozen=True)
class Waiting:
    """The last closed step waits on ``peer`` of ``stage``, for ``for_s`` seconds so far."""

    step: int
    stage: int
    peer: str
    for_s: float

    def line(self) -> str:
        return f"step {self.step} waits on stage {self.stage} replica {self.peer[-8:]} for {self.for_s:.0f} s (it has not reported its result)"


class Holdups:
    """The commit's holdouts, their grace and their strikes (module docstring)."""

    def __init__(
        self, settings: CoordinatorSettings, ledger: TicketLedger, verdicts: VerdictPolicy, *,
        ban: Callable[[str, str, float], object], membership: Callable[[str], float | None] = lambda peer: 0.0,
    ) -> None:
        """``membership(peer)``: when its current membership began (None: not a live member), so that leaving
        and rejoining at once counts as a departure."""
        self.settings = settings
        self.ledger = ledger
        self.verdicts = verdicts
        self.ban = ban
        self.membership = membership
        self._step = -1  # the last closed step the close time belongs to
        self._closed_at: float | None = None
        self._closing: tuple[int, int] | None = None  # (step, revision) of the closing the holds are timed on
        # That closing's participants per stage (its accounting), and those seen departed since.
        self._participants: tuple[tuple[int, int] | None, dict[int, dict[str, list[int]]], dict[str, float | None], set[str]] = (
            None, {}, {}, set())
        # A hold lasts from when the peer was first seen as a holdout until it reports (across steps: a
        # replica that never reported step N holds nothing of step N+1 either).
        self._since: dict[str, float] = {}
        self._struck: dict[str, int] = {}  # strikes taken in the current hold
        self._behind: set[str] = set()  # excused without reporting since: excused at once on later steps
        self._latency: deque[float] = deque(maxlen=RECENT)
        self.waiting: Waiting | None = None

    def grace_s(self) -> float:
        recent = 3 * statistics.median(self._latency) if self._latency else 0.0
        return max(self.settings.commit_grace_s, recent)

    def reported(self, peer: str) -> None:
        """``peer`` reported a result: its hold, and its strikes, end."""
        self._since.pop(peer, None)
        self._struck.pop(peer, None)
        self._behind.discard(peer)

    def watch(self, needed: Callable[[int], Iterable[str]], now: float, sat_out: Collection[str] = ()) -> list[str]:
        """A timer pass: strike and excuse the holdouts of the last closed step. ``sat_out``: stage-0
        replicas struck for late leases of that step (the coordinator saw them sit on their tickets); one
        of them that processed no ticket of the step is
        excused at once, as is a replica excused on an earlier step that has not reported since. Returns
        log lines."""
        ledger = self.ledger
        step = ledger.last_closed
        closed = ledger.closed.get(step)
        if self._since:  # (the live set is every member: built only when someone is being timed, once a second)
            live = {p for s in range(ledger.num_stages) for p in needed(s)}
            for peer in [p for p in self._since if p not in live]:  # it left, expired or was banned
                self.reported(peer)
        if step < 0 or closed is None or ledger.committed(step):
            if self._closed_at is not None and ledger.committed(self._step):
                self._latency.append(now - self._closed_at)
            self._closed_at, self.waiting = None, None
            return []
        if step != self._step or self._closed_at is None:
            self._step, self._closed_at = step, now
        self._restart_after_reopen(step, closed.revision, now)
        # Each stage's waited-for replicas, once per pass (the registry sorts them on every call).
        stages = [set(ledger.waited(needed)(s)) for s in range(ledger.num_stages)]
        self._restart_after_departures(closed, stages, now)
        waited = stages.__getitem__
        holdouts = ledger.barrier.holdouts(waited)
        silent = self._silent_stage(stages, holdouts)
        self.waiting = None
        if not holdouts and silent is None:
            self.waiting = self._unreported(step, stages, now)
            return []
        account = closed.accounting()  # O(B x S): only while someone holds the commit
        if silent is not None:
            holdouts[silent] = sorted(p for p in account.get(silent, {}) if p in stages[silent])
        grace = self.grace_s()
        # Costs go to their cause (DESIGN.md, Trust, rule 3): a stage whose round of this step had a participant
        # the coordinator banned waits on that round to finish without it (the survivors' timeouts, the banned
        # peer's doing). Its holdouts are expelled only after twice the strikes: still a bound, so a colluder
        # that holds such a step for good stalls it for 2 x expel_after_strikes graces, not for ever.
        cut = {stage for stage, peers in account.items() if any(self.verdicts.is_banned(p) for p in peers)}
        events: list[str] = []
        longest: Waiting | None = None
        for stage, peers in sorted(holdouts.items()):
            for peer in peers:
                since = self._since.setdefault(peer, now)
                if longest is None or now - since > longest.for_s:
                    longest = Waiting(step, stage, peer, now - since)
                participant = peer in account.get(stage, {})
                at_once = not participant and (peer in sat_out or peer in self._behind)
                if at_once and not ledger.barrier.excused(peer):
                    ledger.barrier.excuse(peer, participant=False)
                    self._behind.add(peer)
                    why = "it sat on its leases of the step" if peer in sat_out else "it has not reported a result since an earlier step"
                    events.append(f"commit excused peer={peer} step={step}: {why} and processed none of it")
                due = int((now - since) // grace)
                if due < 1:
                    continue
                ledger.barrier.excuse(peer, participant=participant)
                self._behind.add(peer)
                rest = "every other stage had" if stage == silent else f"the rest of stage {stage} had"
                while peer in self._since and self._struck.get(peer, 0) < due:
                    self._struck[peer] = self._struck.get(peer, 0) + 1
                    events.extend(self._strike(peer, step, now - since, rest, now, twice=stage in cut))
        self.waiting = longest or self._unreported(step, stages, now)
        if events:
            d = ledger.try_commit(needed)
            if d.committed:
                events.append(f"step committed step={step} without the replicas that held it")
        return events

    def _restart_after_departures(self, closed: ClosedStep, stages: list[set[str]], now: float) -> None:
        """Costs go to their cause: a participant of the step that left, expired, was banned or lost its
        connection while the step waits to commit leaves its stage's round waiting on it until the others
        hold it out and redo its tickets. That wait is the departed one's: the holds of its stage restart
        their grace (keeping their strikes). Each participant departs at most once per closing, so this
        delays a real holdout's strikes by at most the stage's participants' worth of graces."""
        key = (closed.step, closed.revision)
        if self._participants[0] != key:
            account = closed.accounting()  # O(B x S), once per closing
            since = {p: self.membership(p) for peers in account.values() for p in peers}
            self._participants = (key, account, since, set())
        _, account, since, gone = self._participants
        for stage, peers in account.items():
            left = [p for p in peers if p not in gone and stage < len(stages)
                    and (p not in stages[stage] or self.membership(p) != since.get(p))]
            if not left:
                continue
            gone.update(left)
            grace = self.grace_s()
            for peer in [p for p in self._since if stage < len(stages) and p in stages[stage]]:
                self._since[peer] = now - self._struck.get(peer, 0) * grace

    def _restart_after_reopen(self, step: int, revision: int, now: float) -> None:
        """Costs go to their cause (DESIGN.md, Trust, rule 3): when the step closes again after a redo
        reopened it, its replicas must average it anew, and the time the reopening cost them is the
        reopener's, never theirs. So every hold restarts its grace from this closing (keeping the strikes it
        took: the next one comes a whole grace later). Reopenings are bounded (``max_revisions`` per step,
        ``max_redos_per_peer`` of others' work per peer), so a colluder that keeps reopening a step delays a
        real holdout's strikes by a bounded time, never for good."""
        closing = (step, revision)
        if self._closing is not None and self._closing[0] == step and self._closing[1] != revision:
            grace = self.grace_s()
            for peer in self._since:
                self._since[peer] = now - self._struck.get(peer, 0) * grace
        self._closing = closing

    def silent(self, peer: str) -> bool:
        """Whether ``peer`` held a commit past its grace, or was excused, and has not reported since: for
        the redo rule (``redo.py``'s ``orphaned``), it no longer holds its stage's part of the step."""
        return peer in self._behind

    def _silent_stage(self, stages: list[set[str]], holdouts: dict[int, list[str]]) -> int | None:
        """The one stage none of whose replicas reported while every other stage's all did, or None. Its
        participants (they took part in the step, so only they can finish its round; the replicas the
        accounting left out fetch from them) are its holdouts."""
        reporters = self.ledger.barrier.reporters
        quiet = [s for s, live in enumerate(stages) if s not in holdouts and live and not reporters(s) & live]
        if len(quiet) != 1 or any(live - reporters(s) for s, live in enumerate(stages) if s != quiet[0]):
            return None
        return quiet[0]

    def _unreported(self, step: int, stages: list[set[str]], now: float) -> Waiting | None:
        """With no holdout: the first stage with a live replica that has not reported (a stage none of
        whose replicas has, e.g. its only replica hung), timed from the step's close."""
        reporters = self.ledger.barrier.reporters
        for stage, live in enumerate(stages):
            missing = sorted(live - reporters(stage))
            if missing:
                return Waiting(step, stage, missing[0], now - (self._closed_at or now))
        return None

    def _strike(self, peer: str, step: int, held_s: float, rest: str, now: float, *, twice: bool = False) -> list[str]:
        strikes = self._struck[peer]
        why = f"held the commit of step {step} for {held_s:.1f} s without reporting a result, while {rest}"
        self.verdicts.flag(peer, "commit_hold", why, now)
        out = [f"commit hold peer={peer} strikes={strikes} {why}"]
        limit = self.settings.expel_after_strikes
        if limit is not None and twice:
            limit *= 2  # its round lost a participant the coordinator banned (see watch)
        if limit is not None and strikes >= limit:
            self.reported(peer)  # the hold ends with the ban
            reason = f"liveness: {why} ({strikes} graces in a row)"
            self.ban(peer, reason, now)
            out.append(f"expelled peer={peer} {reason}")
        return out
