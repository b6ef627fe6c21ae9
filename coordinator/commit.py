"""The commit barrier of the last closed step: who holds which averaged result, per stage (sans-IO).

A closed step is not final until it commits: each stage's replicas average it, and each replica
reports :class:`~protolearn.protocol.coordination.Averaged` with the **hash of the averaged update** it
holds (a participant: the collective's result hash; a replica the accounting left out: the hash of the
result it fetched). :class:`CommitBarrier` keeps, per stage, the last hash each replica reported, and
:meth:`CommitBarrier.check` decides.

**The rule.** Let ``L(s)`` be the live serving replicas of stage ``s`` (the registry's ``serving``). The
step commits when, for every stage:

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

The barrier is cleared whenever the last closed step changes (it closes, reopens or closes again); its
memory is bounded by the live members (one entry per reporting replica).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field


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

    def clear(self) -> None:
        for r in self._reports:
            r.clear()

    def report(self, stage: int, peer: str, result_hash: str) -> None:
        """``peer`` of ``stage`` holds a result hashing to ``result_hash`` (its later report replaces it)."""
        self._reports[stage][peer] = result_hash

    def reported(self, stage: int) -> bool:
        return bool(self._reports[stage])

    def winner(self, stage: int, live: Collection[str]) -> str | None:
        """The hash a strict majority of ``live`` reported; with nobody live, the most reported (None on a tie)."""
        votes: dict[str, int] = {}
        reports = self._reports[stage]
        if live:
            for p in live:
                h = reports.get(p)
                if h is not None:
                    votes[h] = votes.get(h, 0) + 1
            best = max(votes.items(), key=lambda kv: kv[1], default=None)
            return best[0] if best is not None and 2 * best[1] > len(live) else None
        for h in reports.values():
            votes[h] = votes.get(h, 0) + 1
        ranked = sorted(votes.values(), reverse=True)
        if not ranked or (len(ranked) > 1 and ranked[0] == ranked[1]):
            return None
        return next(h for h, n in votes.items() if n == ranked[0])

    def dissenters(self, stage: int, live: Collection[str], winner: str) -> list[str]:
        """Live replicas of ``stage`` that reported another hash than ``winner``."""
        reports = self._reports[stage]
        return sorted(p for p in live if p in reports and reports[p] != winner)

    def check(self, needed: Callable[[int], Iterable[str]]) -> CommitCheck:
        """Whether the step commits now, given each stage's live serving replicas ``needed(stage)``."""
        hashes: dict[int, str] = {}
        missing = [s for s in range(self.num_stages) if not self._reports[s]]
        if missing:
            return CommitCheck(False, f"waits for stages {missing} to average")
        for s in range(self.num_stages):
            live = set(needed(s))
            waiting = sorted(live - set(self._reports[s]))
            if waiting:
                return CommitCheck(False, f"waits for replicas {waiting} of stage {s} to hold its result")
            win = self.winner(s, live)
            if win is None:
                return CommitCheck(False, f"stage {s}'s replicas disagree on the result and none has a majority")
            hashes[s] = win
        return CommitCheck(True, "every stage's live replicas hold one result by a strict majority", hashes)
