"""Lease discipline: what a stage-0 member that sits on its leased tickets costs itself (sans-IO).

Each working stage-0 replica may hold at most its *share* of the step at once (the step's tickets over
the working stage-0 replicas, rounded up), so a replica that asks a moment later (e.g. one that just
synced) is not starved by a faster one.

**Late leases.** A stage-0 member that holds a lease past ``lease_late_fraction`` of ``lease_s`` while
it completed nothing for as long gets a strike (flag ``late_leases``), once per lease term; each strike
halves its share down to one ticket, and each ticket it then completes within the late fraction of its
lease takes one strike off. Its tickets are re-issued when their lease runs out, so a step it sits on
closes at most about one ``lease_s`` later, and each later sitting costs it more share.

**Liveness** (issue 11). A strike taken while another stage-0 replica completed a ticket since the late
leases began (so the pipeline behind it works: the fault is this peer's) also ends its leases at once, so
its tickets are re-issued after ``lease_late_fraction * lease_s`` rather than ``lease_s``, and counts
toward expulsion: ``expel_after_strikes`` of them with no completion in between ban it (``liveness: held
N leases past X s without completing any``). Any completion clears that count, even one refused because
its ticket went to another replica meanwhile (:data:`WENT_ELSEWHERE`), provided the last stage's ack of
it checks out: a slow honest replica still delivers, a blackhole never does.

**Costs go to their cause** (DESIGN.md, Trust, rule 3). A holder whose tickets went downstream to a peer that
never sent their gradient back is not the cause of its late leases. So a late holder that reported such a
peer (``liveness:``, see ``verdicts.py``) since its late leases began is not struck, provided the coordinator's
own record agrees: no ticket routed through the reported peer completed since that report. A holder reports
its first lost microbatch (a notice, ``verdicts.py``), then at most once per
:data:`~protolearn.protocol.lost_reports.REPORT_INTERVAL_S`, so a report that much older than the
late lease still counts. A holder that blames a peer which does carry tickets to completion is struck as
before: the word alone excuses nothing.

The strikes are found by :meth:`LeaseDiscipline.strike`, a timer pass over the open step's tickets
(O(B)); the request paths (:meth:`~LeaseDiscipline.share`, :meth:`~LeaseDiscipline.completed`) are O(1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.members import outgrows
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.lost_reports import REPORT_INTERVAL_S

# Refusals of a completion whose ticket went to another replica meanwhile (or was completed by one): a
# struck peer's late completion of such a ticket still shows that it works.
WENT_ELSEWHERE = frozenset({"not_leaseholder", "duplicate", "step_closed"})


class LeaseDiscipline:
    """Stage-0 members' late-lease strikes and liveness strikes, and the lease share they leave each."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        registry: Registry,
        ledger: TicketLedger,
        verdicts: VerdictPolicy,
        *,
        ban: Callable[[str, str, float], object],
        acked: Callable[[cm.Complete], bool],
    ) -> None:
        """``ban(peer, reason, now)`` expels a peer; ``acked(msg)``: whether the last stage signed ``msg``'s
        route and loss."""
        self.settings = settings
        self.registry = registry
        self.ledger = ledger
        self.verdicts = verdicts
        self.ban = ban
        self.acked = acked
        # A lease held this long by a holder that completed nothing for as long is late.
        self.late_s = settings.lease_late_fraction * settings.lease_s
        # Each peer's late-lease strikes, when each last completed a ticket, and the late leases seen.
        self._strikes: dict[str, int] = {}
        self._last_completed: dict[str, float] = {}
        self._late_seen: set[tuple[int, int, float]] = set()
        # Liveness strikes (late while others progressed) and the leases sat on, since each peer's last
        # completion; expel_after_strikes of them ban it.
        self._idle: dict[str, tuple[int, int]] = {}
        # The tickets (step, index) whose leases a liveness strike ended early, per struck peer: a late
        # completion of one of them (refused, as it went elsewhere) still shows the peer works.
        self._ended_early: dict[str, set[tuple[int, int]]] = {}
        # When each peer last completed a ticket (not pruned by time, unlike _last_completed).
        self._progress_at: dict[str, float] = {}
        # The peers struck for late leases in each of the last two steps (sat_out).
        self._late_in: dict[int, set[str]] = {}

    def share(self, peer: str, replicas: int) -> int:
        """The most tickets ``peer`` may hold at once: its share of the step, halved per strike (down to one), among
        ``replicas``, the stage-0 replicas present (``registry.working_present(0)``: a replica whose connection closed,
        because it died, does not count, so its share goes to the others at once, not at its expiry)."""
        share = -(-self.ledger.num_tickets // max(1, replicas))
        return max(1, share >> min(self._strikes.get(peer, 0), 62))

    def completed(self, peer: str, held_s: float, now: float) -> None:
        """``peer`` completed a ticket it held ``held_s``: progress, and a strike off if it was on time."""
        self._last_completed[peer] = now
        self._progress_at[peer] = now
        if self._idle.pop(peer, None) is not None:
            self._ended_early.pop(peer, None)
        strikes = self._strikes.get(peer, 0)
        if strikes and held_s <= self.late_s:
            if strikes > 1:
                self._strikes[peer] = strikes - 1
            else:
                del self._strikes[peer]

    def refused(self, peer: str, code: str, msg: cm.Complete) -> None:
        """``peer``'s completion ``msg`` was refused with ``code``. If the ticket went elsewhere after a
        liveness strike ended its lease, the peer is slow, not a blackhole, provided the last stage
        acknowledged its route: its liveness strikes are cleared."""
        if code not in WENT_ELSEWHERE or peer not in self._idle:
            return
        if (msg.step, msg.index) not in self._ended_early.get(peer, ()) or len(msg.route) != self.ledger.num_stages or msg.route[0] != peer:
            return
        if not self.acked(msg):
            return
        self._idle.pop(peer, None)
        self._ended_early.pop(peer, None)

    def sat_out(self, step: int) -> set[str]:
        """The peers the coordinator saw sit on leases of ``step``: struck for late leases in it (a
        liveness strike that ended them included). Whether they then processed any ticket of the step is
        the accounting's to say (holdups.py)."""
        return set(self._late_in.get(step, ()))

    def strike(self, now: float) -> list[str]:
        """Strike each stage-0 peer holding a lease past the late fraction of ``lease_s`` that completed
        nothing for as long (once per lease term; O(B), the open step's tickets). Returns log lines."""
        late_s = self.late_s
        late: set[tuple[int, int, float]] = set()
        struck: dict[str, list[int]] = {}
        began: dict[str, float] = {}  # the earliest start of each struck holder's late leases
        for t in self.ledger.tickets:
            # (An expired lease, or one ended early, waits for re-issue: its holder was struck for it already.)
            if t.done or t.holder is None or t.expires_at <= now or now - self.ledger.leased_at(t) < late_s:
                continue
            key = (self.ledger.step, t.index, t.expires_at)
            if key in self._late_seen:
                late.add(key)  # struck once for this lease term already
            elif now - self._last_completed.get(t.holder, -math.inf) >= late_s:
                # (A late lease of a holder that completed something lately is looked at again on the next
                # pass: completing one ticket of a block does not buy the right to sit on the rest.)
                late.add(key)
                struck.setdefault(t.holder, []).append(t.index)
                began[t.holder] = min(began.get(t.holder, math.inf), self.ledger.leased_at(t))
        self._late_seen = late
        # Only a completion within late_s counts as progress: older ones go (O(recently active stage-0 peers)).
        self._last_completed = {p: at for p, at in self._last_completed.items() if now - at < late_s}
        events = []
        for peer, tickets in sorted(struck.items()):
            if not self.registry.present(peer):
                continue  # it left, expired or lost its connection: its leases are freed or ended anyway
            cause = self._downstream_cause(peer, began[peer])
            if cause is not None:
                events.append(f"late leases excused peer={peer} tickets={tickets}: it reported {cause}, which carried no ticket to completion since")
                continue
            strikes = self._strikes[peer] = self._strikes.get(peer, 0) + 1
            step = self.ledger.step
            if step not in self._late_in:
                self._late_in = {s: v for s, v in self._late_in.items() if s >= step - 1}
            self._late_in.setdefault(step, set()).add(peer)
            why = f"held tickets {tickets} of step {self.ledger.step} past {late_s:g} s without completing any"
            self.verdicts.flag(peer, "late_leases", why, now)
            events.append(f"late leases peer={peer} strikes={strikes} {why}")
            if self.settings.expel_after_strikes is not None and any(
                p != peer and at >= began[peer] for p, at in self._progress_at.items()
            ):
                events.append(self._liveness_strike(peer, self.settings.expel_after_strikes, len(tickets), now))
        stage0 = self.registry.working(0)
        if outgrows(len(self._strikes), stage0):
            self._strikes = {p: n for p, n in self._strikes.items() if self.registry.is_live(p)}
            self._idle = {p: v for p, v in self._idle.items() if self.registry.is_live(p)}
            self._ended_early = {p: v for p, v in self._ended_early.items() if p in self._idle}
        if outgrows(len(self._progress_at), stage0):
            self._progress_at = {p: v for p, v in self._progress_at.items() if self.registry.is_live(p)}
        return events

    def _downstream_cause(self, peer: str, since: float) -> str | None:
        """A peer ``peer`` reported for lost microbatches since ``since`` that carried no ticket to completion
        after the report (the coordinator's own record), or None."""
        for target, by in self.verdicts.notices.items():
            at = by.get(peer)
            # A holder reports a peer at most once per interval: its last report before the lease began still speaks of it.
            if at is not None and at >= since - REPORT_INTERVAL_S and self.verdicts.carried.get(target, -math.inf) < at:
                return target
        return None

    def _liveness_strike(self, peer: str, limit: int, num_leases: int, now: float) -> str:
        """``peer`` sat on ``num_leases`` leases while other stage-0 replicas completed tickets: end its
        leases now (they are re-issued on the next request) and ban it after ``limit`` such strikes."""
        strikes, leases = self._idle.get(peer, (0, 0))
        strikes, leases = strikes + 1, leases + num_leases
        self._idle[peer] = (strikes, leases)
        if strikes >= limit:
            del self._idle[peer]
            self._ended_early.pop(peer, None)
            reason = (f"liveness: held {leases} leases past {self.late_s:g} s without completing any "
                      f"({strikes} times while other stage-0 replicas completed theirs)")
            self.ban(peer, reason, now)
            return f"expelled peer={peer} {reason}"
        ended = self.ledger.expire_leases(peer, now)
        self._ended_early.setdefault(peer, set()).update((self.ledger.step, i) for i in ended)
        return f"liveness strike peer={peer} {strikes}/{limit}: others complete tickets, it does not; leases ended early tickets={ended}"
