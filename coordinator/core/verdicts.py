"""Fault reports and the ban policy (sans-IO).

A live member reports another member with a reason and, optionally, evidence: two statements the
*accused* signed that contradict each other (``reports.py`` verifies both signatures against
the accused's key and the contradiction before calling :meth:`VerdictPolicy.report`). What the reporter
signs itself proves nothing: it can sign anything.

Policy:

- verified evidence bans at once when ``ban_on_evidence`` is set (off by default);
- a report without it is a claim: it is counted (distinct reporters within ``report_window_s``) and
  never bans by default, because f Sybil identities are f distinct reporters. Only a swarm that sets
  ``reports_to_ban`` (one that trusts its members) bans on that many.

Bans are permanent for the run; replies carry the newest :data:`MAX_BANS_IN_REPLY` of them, and the
coordinator's own host gate refuses every banned peer.

**Flags** are the coordinator's own observations of a member's conduct, not accusations by others:
``redo_storm`` (it asked to redo more of other peers' work in one step than any honest replica needs),
``result_mismatch`` (it reported an averaged result its stage's majority did not hold) and
``late_leases`` (it sat on leased tickets past a fraction of ``lease_s`` without completing any),
``commit_hold`` (it held a step's commit past its grace without reporting its result: ``holdups.py``),
``outer_hold`` (DiLoCo: a live replica its stage's outer round went ahead without, that never arrived: ``outer_desk.py``),
``round_fault`` (a strict majority of its stage's participants named it the cause of their failed round:
``round_faults.py``) and
``lost_microbatches`` (a previous-stage replica reported that microbatches it handed this peer, and the
peer acknowledged, never got their gradient back). A flag counts strikes and shows in ``swarm status``;
it never bans on its own (an honest but slow or unlucky replica earns some), but it is the input a
later policy weighs, and the caller acts on it locally (refuses the peer's further redos of the step,
shrinks its lease share).

**Liveness** (issue 11): a peer that accepts work and never delivers. A stage-0 sitter is judged by the
coordinator's own observation of its leases (``leases.py``, ``expel_after_strikes``). A later-stage
blackhole is seen only by its upstream replicas, so their reports (reason :data:`LIVENESS_REASON`) are
claims: :meth:`VerdictPolicy.liveness_report` bans only when at least 2 distinct reporters that are live
replicas of the stage right before the target's, and a strict majority of that stage, reported it within
``report_window_s``, and the coordinator's own record does not contradict them: a target whose route
carried a ticket to completion after the reports began is flagged only (reports never ban alone; an
honest replica carrying a dead peer's load, slow under it, was once banned this way). Sybils must then
hold a majority of a stage, not merely exist. A peer that itself
reported lost microbatches further down is not banned on such reports (its own missing gradients may be
the downstream blackhole's doing), nor is a stage's only serving replica; both are only flagged. Nor is
a target the coordinator has not heard a heartbeat from for more than two heartbeat intervals: it is
frozen or gone (a suspended laptop, a swap storm), silent to everyone, not present and dropping work, and
its membership expires by itself; a blackhole keeps heartbeating (node-core simulator: an honest stage-1
replica frozen for 4 s was banned on its two upstream replicas' true reports). Such reports are dropped,
with those before them, so that they do not add up to a ban once it is heard again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.pacing import Pacing
from protolearn.protocol.lost_reports import REPORT_AFTER_LOST
from protolearn.protocol.majority import majority_size

# Bound on remembered reports per target (more distinct reporters than this changes no decision).
_MAX_REPORTS_PER_TARGET = 1024
# Bans sent in a join or heartbeat reply: the newest ones (a node's gate only needs the peers it may
# meet; the coordinator refuses every banned peer anyway), so the reply stays under the frame cap.
MAX_BANS_IN_REPLY = 4096
# Bound on flagged peers remembered (the oldest flag is forgotten first); each peer has a few flag kinds.
_MAX_FLAGGED = 100_000
FLAG_KINDS = ("redo_storm", "result_mismatch", "late_leases", "lost_microbatches", "integrity", "commit_hold", "round_fault",
              "outer_hold")
# A report whose reason starts with this is a liveness claim (lost microbatches), weighed by
# :meth:`VerdictPolicy.liveness_report` rather than as a plain report.
LIVENESS_REASON = "liveness:"


@dataclass
class Flag:
    """A peer's strikes of one kind, the last time and reason (for status)."""

    kind: str
    strikes: int
    at: float
    reason: str


@dataclass(frozen=True)
class Ban:
    peer_id: str
    reason: str
    at: float


@dataclass(frozen=True)
class Verdict:
    ban: bool
    reason: str


@dataclass
class VerdictPolicy:
    settings: CoordinatorSettings
    bans: dict[str, Ban] = field(default_factory=dict)
    # target → deque of (time, reporter, reason)
    reports: dict[str, deque[tuple[float, str, str]]] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    # peer → kind → flag (insertion-ordered by peer, so the oldest is dropped first when full)
    flags: dict[str, dict[str, Flag]] = field(default_factory=dict)

    # target → reporter → when it last reported lost microbatches (liveness claims, see the docstring)
    liveness: dict[str, dict[str, float]] = field(default_factory=dict)
    # target → reporter → when it last said a microbatch it handed the target was lost, notices included: what
    # excuses the reporter's late leases (leases.py) and marks a victim of a peer further down
    notices: dict[str, dict[str, float]] = field(default_factory=dict)
    # peer → when a completed ticket's route last went through it past stage 0 (the coordinator's own record:
    # the last stage signed the route); entries older than report_window_s are dropped by prune().
    carried: dict[str, float] = field(default_factory=dict)
    # The heartbeat interval in force, for "silent for two intervals" (pacing.py); None: the settings' fixed one.
    pacing: Pacing | None = None

    # The banned peer IDs, sorted, as every heartbeat reply carries them (rebuilt after a ban).
    _banned: list[str] | None = field(default=None, init=False, repr=False)

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.bans

    def banned(self) -> list[str]:
        """The newest :data:`MAX_BANS_IN_REPLY` banned peer IDs, sorted. Do not modify the list: it is
        shared until the next ban."""
        if self._banned is None:
            newest = sorted(self.bans.values(), key=lambda b: (b.at, b.peer_id))[-MAX_BANS_IN_REPLY:]
            self._banned = sorted(b.peer_id for b in newest)
        return self._banned

    def ban(self, peer_id: str, reason: str, now: float) -> Ban:
        ban = self.bans.get(peer_id)
        if ban is None:
            ban = Ban(peer_id, reason, now)
            self.bans[peer_id] = ban
            self._banned = None
            self.dirty.add(peer_id)
            self.reports.pop(peer_id, None)
            self.liveness.pop(peer_id, None)
            self.notices.pop(peer_id, None)
        return ban

    def restore(self, bans: Iterable[Ban]) -> None:
        """Load the persisted bans after a restart (reports are not persisted: they start afresh)."""
        self.bans = {b.peer_id: b for b in bans}
        self._banned = None
        self.reports.clear()
        self.dirty.clear()

    def drain(self) -> list[Ban]:
        """Take the bans made since the last drain, to persist, sorted by peer ID."""
        out = [self.bans[p] for p in sorted(self.dirty)]
        self.dirty.clear()
        return out

    def already_banned(self, target: str) -> Verdict | None:
        """The verdict on any report of ``target`` once it is banned, or None while it is not."""
        ban = self.bans.get(target)
        return None if ban is None else Verdict(True, f"{target} is already banned: {ban.reason}")

    def report(self, reporter: str, target: str, reason: str, *, evidence_verified: bool, now: float) -> Verdict:
        banned = self.already_banned(target)
        if banned is not None:
            return banned
        if evidence_verified and self.settings.ban_on_evidence:
            ban = self.ban(target, f"signed evidence from {reporter}: {reason}", now)
            return Verdict(True, ban.reason)
        window = self.settings.report_window_s
        q = self.reports.setdefault(target, deque(maxlen=_MAX_REPORTS_PER_TARGET))
        while q and now - q[0][0] > window:
            q.popleft()
        q.append((now, reporter, reason))
        reporters = {r for _, r, _ in q}
        need = self.settings.reports_to_ban
        if need is None:
            return Verdict(False, f"{target} reported by {len(reporters)} peers; a report without evidence the accused signed never bans")
        if len(reporters) >= need:
            ban = self.ban(target, f"reported by {len(reporters)} peers within {window:g} s: {reason}", now)
            return Verdict(True, ban.reason)
        return Verdict(False, f"{target} reported by {len(reporters)} of {need} distinct peers needed for a ban")

    def liveness_report(
        self, reporter: str, target: str, reason: str, *, target_stage: int, upstream: Collection[str], now: float,
        replicas: int = 2, heard_s_ago: float = 0.0, lost: int,
    ) -> Verdict:
        """``reporter`` says ``lost`` microbatches in a row that it handed ``target`` (of ``target_stage``) never
        came back. Fewer than :data:`REPORT_AFTER_LOST` (0 included: the target left holding some) make a
        notice only (:mod:`protolearn.protocol.lost_reports`): recorded in :attr:`notices`, nothing more.

        ``upstream``: the live replicas of stage ``target_stage - 1`` now. Flags ``target`` every time; bans
        it on at least 2 distinct reporters in ``upstream`` that are also a strict majority of it, within
        ``report_window_s``, unless a ticket routed through ``target`` completed after the earliest of those
        reports, or ``target`` itself reported lost microbatches in that window, or it is
        its stage's only serving replica (``replicas``): a ban would leave the stage empty and stall the run
        as surely, and an honest sole replica under load is the likelier story, or the coordinator itself
        has not heard from ``target`` for ``heard_s_ago`` > 2 heartbeat intervals (frozen or gone).
        """
        banned = self.already_banned(target)
        if banned is not None:
            return banned
        window = self.settings.report_window_s
        self._prune_liveness(now)
        told = self.notices.setdefault(target, {})
        if len(told) >= _MAX_REPORTS_PER_TARGET and reporter not in told:
            del told[min(told, key=told.__getitem__)]
        told[reporter] = now
        if lost < REPORT_AFTER_LOST:
            return Verdict(False, f"noted: {reporter} lost {lost} microbatch(es) in a row to {target}; "
                                  f"{REPORT_AFTER_LOST} in a row make a report that counts")
        interval = self.settings.heartbeat_interval_s if self.pacing is None else self.pacing.interval_s
        if heard_s_ago > 2 * interval:
            # Silent to the coordinator too: its absence explains the losses, these and the ones reported before.
            self.liveness.pop(target, None)
            self.flag(target, "lost_microbatches", f"reported by {reporter} while silent: {reason}", now)
            return Verdict(False, f"{target} has not heartbeated for {heard_s_ago:.1f} s either (the coordinator's own record): it is "
                                  "frozen or gone, not dropping work while present; flagged only, and its membership expires")
        by = self.liveness.setdefault(target, {})
        if len(by) >= _MAX_REPORTS_PER_TARGET and reporter not in by:
            del by[min(by, key=by.__getitem__)]
        by[reporter] = now
        self.flag(target, "lost_microbatches", f"reported by {reporter}: {reason}", now)
        if target_stage < 1:
            return Verdict(False, f"{target} is a stage-0 replica: its liveness is judged by its leases, not by reports")
        live = set(upstream)
        agree = sorted(r for r in by if r in live)
        need = max(2, majority_size(len(live)))
        if len(agree) < need:
            return Verdict(False, f"{target} reported for lost microbatches by {len(agree)} of the {len(live)} live stage-{target_stage - 1} "
                                  f"replicas; {need} needed for a ban")
        since = min(by[r] for r in agree)
        if self.carried.get(target, float("-inf")) >= since:
            return Verdict(False, f"{target} carried a ticket to completion {now - self.carried[target]:.1f} s ago, after the reports "
                                  "began (the coordinator's own record): lost microbatches are not proof that it drops work; flagged only")
        if any(target in reporters for reporters in self.notices.values()):
            return Verdict(False, f"{target} reported lost microbatches itself: it may be the victim of a peer further down; flagged only")
        if replicas <= 1:
            return Verdict(False, f"{target} is the only serving replica of stage {target_stage}; flagged only")
        if not self.settings.expel_on_liveness_reports:
            return Verdict(False, f"{target} reported by {len(agree)} stage-{target_stage - 1} replicas; liveness reports never ban here")
        ban = self.ban(target, f"liveness: {len(agree)} of {len(live)} live stage-{target_stage - 1} replicas reported within {window:g} s "
                               f"that microbatches it acknowledged never came back ({reason})", now)
        return Verdict(True, ban.reason)

    def suspects(self, keep: Callable[[str], bool], now: float) -> list[str]:
        """The reported peers for which ``keep`` holds that a report counting toward a liveness ban named within
        the window and that carried no ticket to completion since the earliest such report (the coordinator's
        own record): routers give them less work (:data:`~protolearn.node.core.balancer.SUSPECT_FACTOR`), and
        one completion clears it. O(reported peers), not O(members)."""
        window = self.settings.report_window_s
        out = []
        for p, by in self.liveness.items():
            times = [at for at in by.values() if now - at <= window]
            if times and self.carried.get(p, float("-inf")) < min(times) and keep(p):
                out.append(p)
        return sorted(out)

    def completed(self, route: Iterable[str], now: float) -> None:
        """A ticket along ``route`` completed (its last-stage ack verified): every hop past stage 0 carried it."""
        for hop in list(route)[1:]:
            self.carried.pop(hop, None)
            self.carried[hop] = now  # re-inserted: the dict stays ordered oldest first

    def _prune_liveness(self, now: float) -> None:
        window = self.settings.report_window_s
        while self.carried:
            oldest = next(iter(self.carried))
            if now - self.carried[oldest] <= window:
                break
            del self.carried[oldest]
        for table in (self.liveness, self.notices):
            for target in list(table):
                by = {r: at for r, at in table[target].items() if now - at <= window}
                if by:
                    table[target] = by
                else:
                    del table[target]

    def flag(self, peer: str, kind: str, reason: str, now: float) -> Flag:
        """Add a strike of ``kind`` to ``peer`` (never bans on its own; see the module docstring)."""
        if kind not in FLAG_KINDS:
            raise ValueError(f"unknown flag kind {kind!r}; one of {FLAG_KINDS}")
        kinds = self.flags.get(peer)
        if kinds is None:
            while len(self.flags) >= _MAX_FLAGGED:
                del self.flags[next(iter(self.flags))]
            kinds = self.flags[peer] = {}
        f = kinds.get(kind)
        if f is None:
            f = kinds[kind] = Flag(kind, 0, now, reason)
        f.strikes, f.at, f.reason = f.strikes + 1, now, reason
        return f

    def flags_of(self, peer: str) -> list[str]:
        """``peer``'s flags as ``kind:strikes`` (what ``swarm status`` shows)."""
        return [f"{k}:{f.strikes}" for k, f in sorted(self.flags.get(peer, {}).items())]

    def prune(self, now: float) -> None:
        window = self.settings.report_window_s
        self._prune_liveness(now)
        for target in list(self.reports):
            q = self.reports[target]
            while q and now - q[0][0] > window:
                q.popleft()
            if not q:
                del self.reports[target]
