"""The commit barrier of the last closed step: who holds which averaged result, per stage (sans-IO).

A closed step is not final until it commits: each stage's replicas average it, and each replica
reports :class:`~protolearn.protocol.coordination.Averaged` with the **hash of the averaged update** it
holds (a participant: the collective's result hash; a replica the accounting left out: the hash of the
result it fetched). :class:`CommitBarrier` keeps, per stage, the last hash each replica reported, and
:meth:`CommitBarrier.check` decides.

**The rule.** Let ``L(s)`` be the live serving replicas of stage ``s`` whose connection to the coordinator
is open (the registry's ``reachable``: a replica whose connection closed cannot report, so the commit
does not wait out the disconnect grace for it). The step commits when, for every stage:

1. one hash ``h(s)`` is reported by a strict majority of ``L(s)`` (more than ``|L(s)| / 2``), and
2. every replica of ``L(s)`` has reported (``h(s)``, or another hash: see below).

A stage whose replicas are all gone (``L(s)`` empty) needs one report from a replica that held the
result (it may have died after reporting; its stage restores from a checkpoint), and, when several
hashes were reported, one that more of them named than any other.

Why waiting for every live replica: the result then survives the death of every participant right
after the commit (I6: a left-out replica that fetched it holds it too), as before hashes existed.

**A liar cannot commit a stage alone**: its report is one vote, and no hash commits without a strict
majority of the stage's live replicas. With honest replicas in the majority, the committed hash is the
one the collective gave every honest survivor (the collective makes their results bit-identical).

**A liar cannot block the commit forever.** A replica that reports a hash other than the majority's
still counts as having reported (condition 2), so it does not hold the step; it is refused with
``result_mismatch`` (on that report or its next poll: the node re-reports on every poll) and resyncs
from a majority replica instead of applying. Only a replica that never reports holds the step, and it
does so exactly as long as it stays a live serving member (its heartbeats keep it live), which the
liveness checks, not the barrier, bound. What the barrier cannot do is tell a liar from an honest
replica when neither side has a majority: a stage of two replicas that disagree does not commit (it
halts, visibly, with both flagged) rather than apply an update one unknown side vouches for.

The barrier is the one owner of the last committed step (``committed_through``; the ticket ledger
reads it from here) and of the hashes it committed with, so a late report of the committed step with
another hash is refused too. Its reports are cleared whenever the last closed step changes (it closes,
reopens or closes again); their memory is bounded by the live members (one entry per reporting replica).
Reports are not persisted: holders report again on every poll.

**A replica that never reports** (a hung device, a peer that answers probes and sends nothing) is
bounded by the coordinator's own clock (``holdups.py``): once it has been the only kind of replica its
stage waits for (the others hold one result) for its grace, the barrier :meth:`excuses
<CommitBarrier.excuse>` it: condition 2 no longer waits for it, and condition 1 still counts it if it
processed a ticket of the step (it contributed to the round, so the round's other contributors need a
strict majority without it), else not (it holds nothing of the step: ``L(s)`` loses it for this step,
and it reports the committed hash later or resyncs). Each grace it keeps holding is a strike toward its
expulsion.

**At the revision cap** (``max_revisions``, see ``tickets.py``) the step waits only for each stage's
live *participants* (:func:`waited_for`): a dead participant's tickets can no longer be redone, so its
stage's survivors apply the round they have and serve no result to fetch, and a left-out replica, which
could then never report, resyncs from a replica that applied the step once it commits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from protolearn.coordinator.core.steps import ClosedStep
from protolearn.protocol.majority import strict_majority


@dataclass(frozen=True)
class AveragedDecision:
    accepted: bool
    committed: bool
    reason: str
    code: str = "ok"


@dataclass(frozen=True)
class CommitCheck:
    """The decision: ``commit`` with each stage's winning ``hashes``, else the ``reason`` it waits."""

    commit: bool
    reason: str
    hashes: dict[int, str] = field(default_factory=dict)


class CommitBarrier:
    """Per stage, the result hash each replica reported for the last closed step's current revision."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self._reports: list[dict[str, str]] = [{} for _ in range(num_stages)]
        # The last step that committed, whether that changed since the store last took it, and the
        # result hash each stage committed it with.
        self.committed_through = -1
        self.dirty = False
        self.hashes: dict[int, str] = {}
        # Live replicas the commit no longer waits for (holdups.py): they held it past their grace; and
        # those of them that took part in no ticket of the step, which no longer count in its majority.
        self._excused: set[str] = set()
        self._dropped: set[str] = set()

    def restore(self, committed_through: int, *, dirty: bool) -> None:
        self.committed_through, self.dirty, self.hashes = committed_through, dirty, {}
        self.clear()

    def clear(self) -> None:
        for r in self._reports:
            r.clear()
        self._excused.clear()
        self._dropped.clear()

    def excuse(self, peer: str, *, participant: bool) -> None:
        """Stop waiting for ``peer``'s report of the last closed step (it held the commit past its grace;
        see holdups.py). A ``participant`` (it processed a ticket of the step, by the coordinator's
        accounting) still counts in its stage's majority, so excusing it never lets a minority of the
        round's contributors commit; a replica that took part in nothing holds nothing of the step and
        is dropped from the count too. Cleared with the reports."""
        self._excused.add(peer)
        if not participant:
            self._dropped.add(peer)

    def excused(self, peer: str) -> bool:
        return peer in self._excused

    def _live(self, stage: int, needed: Callable[[int], Iterable[str]]) -> set[str]:
        return set(needed(stage)) - self._dropped

    def reporters(self, stage: int) -> set[str]:
        """The replicas of ``stage`` that reported the last closed step's current revision."""
        return set(self._reports[stage])

    def holdouts(self, needed: Callable[[int], Iterable[str]]) -> dict[int, list[str]]:
        """Per stage, the live replicas ``needed(stage)`` that have not reported while the others hold one
        result: every other live replica reported it (at least one), or a strict majority of the live
        replicas did. Whoever the stage's commit then waits on is a holdout."""
        out: dict[int, list[str]] = {}
        for s in range(self.num_stages):
            live, reports = set(needed(s)), self._reports[s]
            done = live & set(reports)
            missing = live - done
            if not done or not missing or len({reports[p] for p in done}) != 1:
                continue
            if len(missing) == 1 or 2 * len(done) > len(live):
                out[s] = sorted(missing)
        return out

    def committed(self, step: int) -> bool:
        return step <= self.committed_through

    def averaged(
        self, peer: str, stage: int, step: int, revision: int, result_hash: str, revision_now: int | None,
        needed: Callable[[int], Iterable[str]],
    ) -> AveragedDecision:
        """``peer`` (of ``stage``) holds the full average of ``step`` at ``revision``, hashing to
        ``result_hash``: it took part in a round that had every contribution in, or, left out of the
        accounting, it fetched such a round's result (participants serve only complete results).
        ``revision_now``: the last closed step's current revision when ``step`` is that step, else None.

        The step commits by the rule in the module docstring. A report whose hash is not the majority's
        (or the committed one's) is refused with ``result_mismatch`` but still recorded, so that a liar
        counts as having reported and cannot hold the step.
        """
        if not 0 <= stage < self.num_stages:
            return AveragedDecision(False, False, f"stage {stage} is outside 0..{self.num_stages - 1}", "bad_stage")
        if self.committed(step):
            won = self.hashes.get(stage) if step == self.committed_through else None
            if won is not None and result_hash != won:
                return AveragedDecision(
                    False, True, f"step {step} committed stage {stage}'s result {won[:12]}, not {result_hash[:12]}; resync",
                    "result_mismatch",
                )
            return AveragedDecision(True, True, f"step {step} is committed")
        if revision_now is None:
            return AveragedDecision(False, False, f"step {step} is not the last closed step", "step_not_closed")
        if revision != revision_now:
            return AveragedDecision(
                False, False, f"step {step} is at revision {revision_now}, not {revision}; average that one", "stale_revision"
            )
        self.report(stage, peer, result_hash)
        won = self.winner(stage, self._live(stage, needed))
        if won is not None and result_hash != won:
            self.try_commit(step, revision_now, needed)  # the dissenter has reported: the others may commit without it
            return AveragedDecision(
                False, self.committed(step),
                f"stage {stage}'s majority holds result {won[:12]}, not {result_hash[:12]}; resync", "result_mismatch",
            )
        return self.try_commit(step, revision_now, needed)

    def try_commit(self, step: int, revision: int | None, needed: Callable[[int], Iterable[str]]) -> AveragedDecision:
        """Commit ``step`` (the last closed one, at ``revision``; None: not kept) if its stages agree."""
        if step < 0 or self.committed(step) or revision is None:
            return AveragedDecision(False, False, f"step {step} has nothing left to commit")
        check = self.check(needed)
        if not check.commit:
            return AveragedDecision(True, False, f"step {step} {check.reason}")
        self.hashes, self.committed_through, self.dirty = check.hashes, step, True
        return AveragedDecision(True, True, f"step {step} committed at revision {revision}")

    def report(self, stage: int, peer: str, result_hash: str) -> None:
        """``peer`` of ``stage`` holds a result hashing to ``result_hash`` (its later report replaces it)."""
        self._reports[stage][peer] = result_hash

    def winner(self, stage: int, live: Collection[str]) -> str | None:
        """The hash a strict majority of ``live`` reported; with nobody live, the most reported (None on a tie)."""
        votes: dict[str, int] = {}
        reports = self._reports[stage]
        if live:
            return strict_majority((reports[p] for p in live if p in reports), len(live))
        for h in reports.values():
            votes[h] = votes.get(h, 0) + 1
        ranked = sorted(votes.values(), reverse=True)
        if not ranked or (len(ranked) > 1 and ranked[0] == ranked[1]):
            return None
        return next(h for h, n in votes.items() if n == ranked[0])

    def check(self, needed: Callable[[int], Iterable[str]]) -> CommitCheck:
        """Whether the step commits now, given each stage's live serving replicas ``needed(stage)``."""
        hashes: dict[int, str] = {}
        missing = [s for s in range(self.num_stages) if not self._reports[s]]
        if missing:
            return CommitCheck(False, f"waits for stages {missing} to average")
        for s in range(self.num_stages):
            live = self._live(s, needed)
            waiting = sorted(live - set(self._reports[s]) - self._excused)
            if waiting:
                return CommitCheck(False, f"waits for replicas {waiting} of stage {s} to hold its result")
            win = self.winner(s, live)
            if win is None:
                return CommitCheck(False, f"stage {s}'s replicas disagree on the result and none has a majority")
            hashes[s] = win
        return CommitCheck(True, "every stage's live replicas hold one result by a strict majority", hashes)


def waited_for(
    needed: Callable[[int], Iterable[str]], closed: ClosedStep | None, max_revisions: int
) -> Callable[[int], Iterable[str]]:
    """The replicas the commit of ``closed`` (the last closed step) waits for, given each stage's live
    serving replicas ``needed(stage)``: every one, or, once ``closed`` is at the last allowed revision,
    only those that took part in it (see the module docstring)."""
    if closed is None or closed.revision < max_revisions:
        return needed
    account = closed.accounting()
    return lambda s: [p for p in needed(s) if p in account.get(s, {})]
