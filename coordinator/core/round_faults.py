"""Who caused a stage's collective round to fail, by the word of that stage's own participants (sans-IO).

When a replica's round of a closed step fails, it asks for the step to be redone (``coord.redo`` with kind
``round_failed``), naming the participants whose statements or silence ended the round there, as its
collective found them (:attr:`~protolearn.protocol.collective.Failed.missing`: a peer that signed a fin
without it, two different fins or parts, a veto, or that never sent its part). Who pays for the redo
(DESIGN.md, Trust, rule 3: costs go to their cause; rule 4: the accuser never picks the witnesses):

- a cause that a **strict majority of the step's participants of that stage** (the coordinator's frozen
  accounting, not anyone's claim) name for the same revision is **corroborated**: the redos that named it
  cost their senders nothing (the redo budget gives back what it took), and the cause takes a
  ``round_fault`` strike; ``expel_after_strikes`` of them within ``report_window_s`` ban it;
- a cause that only a minority names is one peer's word: the sender pays for its own redo, as for a redo
  that names no cause (its redo budget, ``redo.py``), and nobody is struck;
- in a round of **two** participants nobody can be corroborated (the accused is half of it), so the cause
  is unknown: neither pays, nobody is struck;
- either way, a corroborated cause, and in a round of two whoever the other named, **sits out the rest of
  the step** (:meth:`RoundFaults.barred`): a barred stage-0 replica leases none of its redone tickets, and
  stage-0 holders route none through a barred stage-1 replica (``LeaseReply.avoid``), unless that would
  leave its stage without a replica. So the redo runs among the others and a cause cannot fail the same
  step again: a liar that is half of a round of two cannot stall the step, nor make the honest half pay.

Why this is safe. With honest replicas a strict majority of a stage's participants, a liar that fails the
honest replicas' rounds is named by all of them, so it pays and is expelled after a few rounds, while the
honest replicas' redos stay free (before, they drained their own budgets, were refused, resynced, and left
the liar alone in the stage's commit: issue 27's stage takeover). Liars can name an honest peer as the
cause, but a minority's naming corroborates nothing and costs them their own budgets; a liar that fails
only some honest replicas' rounds is never named by a majority, and those replicas take the stage's
result from the others instead of redoing the step (``node/core/closed_step.py``). A stage of two has no
majority besides the accused, so nobody there is ever corroborated (as with its commit, it has no honest
majority to stand on). An honest replica that its stage-mates really cannot reach is named by all of them
and struck like a liar: the cost of its unreachability is its own, and the ban needs several such rounds.

Memory: the namings of the last closed step only (older ones can no longer reopen anything), at most one
entry per participant; the fault times per struck peer, pruned with the report window.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.protocol.majority import majority_size

log = logging.getLogger("protolearn.coordinator")


@dataclass(frozen=True)
class Named:
    """What one naming decided: the causes it named for which the sender pays nothing (corroborated, or any in
    a round of two), and the earlier senders whose redos of this round named a newly corroborated cause (to be
    given their budget back)."""

    corroborated: frozenset[str] = frozenset()
    refund: tuple[str, ...] = ()
    events: list[str] = field(default_factory=list)


class RoundFaults:
    """The causes named for the failed rounds of the last closed step, and the strikes of corroborated ones."""

    def __init__(self, settings: CoordinatorSettings, verdicts: VerdictPolicy, *, ban: Callable[[str, str, float], object]) -> None:
        self.settings = settings
        self.verdicts = verdicts
        self.ban = ban
        # (step, revision, stage) -> sender -> the causes it named
        self._named: dict[tuple[int, int, int], dict[str, frozenset[str]]] = {}
        # (step, revision, stage) -> causes already corroborated (struck once per round)
        self._corroborated: dict[tuple[int, int, int], set[str]] = {}
        # cause -> when each of its corroborated faults happened (within report_window_s)
        self._faults: dict[str, deque[float]] = {}
        # step -> the peers that sit out the rest of it (see the module docstring)
        self._barred: dict[int, set[str]] = {}

    def name(
        self, sender: str, *, step: int, revision: int, stage: int, causes: Collection[str], participants: Collection[str], now: float,
    ) -> Named:
        """``sender``, a participant of ``stage`` in ``step`` at ``revision`` (``participants``: the stage's
        participants by the coordinator's accounting), names ``causes`` for its failed round."""
        members = set(participants)
        if sender not in members:
            return Named()
        named = frozenset(c for c in causes if c in members and c != sender)
        key = (step, revision, stage)
        self._prune(step, now)
        namers = self._named.setdefault(key, {})
        namers[sender] = named
        done = self._corroborated.setdefault(key, set())
        need = majority_size(len(members))
        fresh: list[str] = []
        for cause in sorted(named - done):
            if sum(cause in c for c in namers.values()) >= need:
                done.add(cause)
                fresh.append(cause)
        events: list[str] = []
        for cause in fresh:
            events += self._strike(cause, step, revision, stage, now)
        barred = self._barred.setdefault(step, set())
        barred.update(done)
        two = len(members) == 2
        if two:
            barred.update(named)  # a round of two: the cause is unknown, and the named one sits the redo out
        refund = tuple(sorted(p for p, c in namers.items() if p != sender and c & set(fresh)))
        return Named(frozenset(named & done) | (named if two else frozenset()), refund, events)

    def barred(self, step: int, stage_of: Callable[[str], int | None], serving: Callable[[int], Collection[str]], stage: int) -> set[str]:
        """The members of ``stage`` (``stage_of``: a member's assigned stage) that sit out the rest of ``step``,
        whatever they claim to be doing, unless every one of the stage's ``serving(stage)`` replicas is among
        them (then nobody sits out there: the stage must keep someone). O(1) while nobody is barred."""
        bars = {p for p in self._barred.get(step, ()) if stage_of(p) == stage}
        if not bars or set(serving(stage)) <= bars:
            return set()
        return bars

    def faults(self, peer: str) -> int:
        """Corroborated round faults of ``peer`` within the report window."""
        return len(self._faults.get(peer, ()))

    def _strike(self, cause: str, step: int, revision: int, stage: int, now: float) -> list[str]:
        window = self.settings.report_window_s
        times = self._faults.setdefault(cause, deque())
        times.append(now)
        while times and now - times[0] > window:
            times.popleft()
        why = f"a strict majority of stage {stage}'s participants named it the cause of their failed round of step {step} (revision {revision})"
        self.verdicts.flag(cause, "round_fault", why, now)
        out = [f"round fault peer={cause} faults={len(times)} {why}"]
        limit = self.settings.expel_after_strikes
        if limit is not None and len(times) >= limit:
            del self._faults[cause]
            reason = f"liveness: {why}; {limit} such rounds within {window:g} s"
            self.ban(cause, reason, now)
            out.append(f"expelled peer={cause} {reason}")
        log.warning("%s", out[-1])
        return out

    def _prune(self, step: int, now: float) -> None:
        """Keep the namings of ``step`` only (a redo of an older step is refused anyway); fault times expire."""
        for table in (self._named, self._corroborated):
            for key in [k for k in table if k[0] != step]:
                del table[key]
        for old in [k for k in self._barred if k != step]:
            del self._barred[old]
        window = self.settings.report_window_s
        for peer in list(self._faults):
            times = self._faults[peer]
            while times and now - times[0] > window:
                times.popleft()
            if not times:
                del self._faults[peer]
