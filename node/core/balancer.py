"""Which peer of the next stage gets the next microbatch: least expected finish time.

A sans-IO core. For every candidate peer it keeps exponential moving averages of how long a
microbatch takes there (service time, measured from send to the peer's answer) and of the queue the
peer reports, plus the microbatches this node has outstanding with it. The expected finish time of
one more microbatch is::

    (max(reported_queue, outstanding, awaited) + 1) * service_time_ema + failure_penalty

where ``awaited`` is the microbatches this node handed to the peer whose gradient has not come back
(the caller's ticket record knows them; :meth:`Balancer.choose` takes them). A peer that computes a
microbatch faster than this node sends the next reports an empty queue and answers at once, so without
``awaited`` two idle replicas tie and the smaller peer id took every microbatch while the other
replica never trained (and never got a service time measured).

A failure adds a penalty that decays over ``penalty_half_life_s``, so a flaky peer is avoided for a
while and then tried again; a banned peer is never chosen. A peer the coordinator names a suspect (others
reported it for lost microbatches, unanswered by any completion since) looks :data:`SUSPECT_FACTOR` times
slower: a report lowers its share of the work, never to nothing (DESIGN.md, Trust: a word only makes others
look for themselves). A peer that refused because it is not ready
for the step (it is behind it: still syncing, or not yet applied the step before) is no failure: it is
skipped while any other peer is ready, for :data:`NOT_READY_S`, doubled per refusal in a row up to
:data:`NOT_READY_MAX_S` (:meth:`Balancer.on_not_ready`), and one accepted microbatch resets that. With
the failure penalty a joiner that refused twice while the view still showed it training (a resync) was
avoided for half a minute. Ties go by an order of the peers that is this node's own (``order``: its peer id,
hashed with each candidate's), so the choice is deterministic for a given history, and different senders
break ties differently: with one order for all (the smaller peer id), every replica of a stage sent its first
microbatch of a step to the same peer, its second to the next, and so on, so in a large stage the
replicas at the end of the order got no work at all (issue 26: a third of a 31-replica stage of the
simulated 1,000-node swarm took no ticket, and had to fetch each step's result).
:meth:`Balancer.choose` returns the peer and the reason.

Liveness (issue 11): a peer can Ack a microbatch and never send its gradient back (a blackhole). Which
hand-overs are still awaited is the ticket record's (:mod:`.tickets`); the balancer keeps what follows
for each peer. :meth:`Balancer.on_returned` measures a gradient's round trip and resets the peer's
losses in a row; :meth:`Balancer.deadline_s` is how long a hand-over may stay unanswered:
``overdue_factor`` times the slowest round trip seen lately (so a loaded swarm is not mistaken for a
blackhole), at least ``min_deadline_s`` and at most the caller's cap. Each lost microbatch
(:meth:`Balancer.on_lost`) doubles the peer's penalty (so the blackhole stops getting work after a few)
and counts in :meth:`Balancer.lost`. :mod:`.routing` puts the two together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

# With no measurement yet, a peer is assumed as fast as the average known peer, or this.
DEFAULT_SERVICE_S = 0.05
EMA_ALPHA = 0.3
FAILURE_PENALTY_S = 5.0
PENALTY_HALF_LIFE_S = 10.0
# A handed microbatch whose gradient has not come back within OVERDUE_FACTOR x the slowest recent round
# trip (at least MIN_DEADLINE_S) is lost.
OVERDUE_FACTOR = 4.0
MIN_DEADLINE_S = 2.0
# A peer that is not ready for the step is skipped for this long, doubled per refusal in a row, at most the max.
NOT_READY_S = 0.5
NOT_READY_MAX_S = 30.0
# A suspect (the coordinator's word: stage-0 replicas reported it for lost microbatches, and it has carried no
# ticket to completion since) looks this many times slower: it gets less work, not none, so an honest peer a
# liar reported still carries tickets, and one completion clears it.
SUSPECT_FACTOR = 2.0


@dataclass(frozen=True)
class Choice:
    """The chosen peer (``None`` when no candidate is usable) and why (written out only when read: a swarm
    makes a choice per microbatch and stage, and seldom logs one)."""

    peer: str | None
    why: str = ""  # when no candidate is usable
    expected_s: float = float("inf")
    queue: float = 0.0
    of: int = 0  # usable candidates

    @property
    def reason(self) -> str:
        if self.peer is None:
            return self.why
        return f"least expected finish {self.expected_s:.3f} s (queue {self.queue:.0f}, of {self.of} peers)"


@dataclass
class PeerStats:
    service_s: float | None = None
    reported_queue: float = 0.0
    outstanding: int = 0
    penalty_s: float = 0.0
    penalty_at: float = 0.0
    failures: int = 0
    # Microbatches handed to it in a row whose gradient never came back.
    lost: int = 0
    # Skipped while another peer is ready until then; refusals "not ready" in a row.
    not_ready_until: float = 0.0
    not_ready: int = 0


@dataclass
class Balancer:
    """Least-expected-finish-time choice among the peers of one downstream (or upstream) stage."""

    alpha: float = EMA_ALPHA
    failure_penalty_s: float = FAILURE_PENALTY_S
    penalty_half_life_s: float = PENALTY_HALF_LIFE_S
    default_service_s: float = DEFAULT_SERVICE_S
    overdue_factor: float = OVERDUE_FACTOR
    min_deadline_s: float = MIN_DEADLINE_S
    _stats: dict[str, PeerStats] = field(default_factory=dict)
    _banned: set[str] = field(default_factory=set)
    suspects: frozenset[str] = frozenset()
    # Whose tie order this is (its peer id; "" = the peers' own order): see the module docstring.
    order: str = ""
    _ranks: dict[str, bytes] = field(default_factory=dict)
    # Slowest round trip (hand-over to gradient back) seen lately: an EMA that jumps up at once.
    _round_trip_s: float | None = None
    # The sum and count of the measured peers' service times, kept as they change: _prior() is their mean.
    _known_sum: float = 0.0
    _known_n: int = 0

    def _get(self, peer: str) -> PeerStats:
        st = self._stats.get(peer)
        if st is None:
            st = self._stats[peer] = PeerStats()
        return st

    def _penalty(self, st: PeerStats, now: float) -> float:
        if st.penalty_s <= 0:
            return 0.0
        return st.penalty_s * 0.5 ** (max(0.0, now - st.penalty_at) / self.penalty_half_life_s)

    def _prior(self) -> float:
        """The service time assumed for an unmeasured peer: the average of the measured ones, from a sum kept
        as measurements change (:meth:`on_done`, :meth:`forget`). Summing them per choice made a choice
        O(peers known) however few candidates it scored: 3.5% of a 3,000-node simulation, where each
        measurement came between two choices."""
        return self._known_sum / self._known_n if self._known_n else self.default_service_s

    def expected_finish_s(self, peer: str, now: float, awaited: int = 0) -> float:
        return self._finish(peer, now, awaited, None)

    def _finish(self, peer: str, now: float, awaited: int, prior: float | None) -> float:
        """:meth:`expected_finish_s`, with the prior of unmeasured peers computed by the caller (once per choice:
        it averages every known peer, so computing it per candidate made a choice O(candidates × peers))."""
        st = self._get(peer)
        if st.service_s is not None:
            service = st.service_s
        else:
            service = self._prior() if prior is None else prior
        finish = (self._queue(st, awaited) + 1.0) * service + self._penalty(st, now)
        return finish * SUSPECT_FACTOR if peer in self.suspects else finish

    def _rank(self, peer: str) -> bytes | str:
        """``peer``'s place in this node's tie order."""
        if not self.order:
            return peer
        got = self._ranks.get(peer)
        if got is None:
            got = self._ranks[peer] = hashlib.blake2b(f"{self.order}\x00{peer}".encode(), digest_size=8).digest()
        return got

    @staticmethod
    def _queue(st: PeerStats, awaited: int) -> float:
        return max(st.reported_queue, float(st.outstanding), float(awaited))

    # -- decisions -------------------------------------------------------------------------------
    def choose(self, candidates: list[str], now: float, awaited: Mapping[str, int] | None = None) -> Choice:
        """The usable candidate with the least expected finish; ``awaited``: per peer, the microbatches
        handed to it whose gradient is still awaited."""
        # The least (expected finish, tie rank) wins whatever the candidates' order, so they are not sorted.
        banned = self._banned
        usable = [p for p in dict.fromkeys(candidates) if p not in banned] if banned else list(dict.fromkeys(candidates))
        if not usable:
            why = "no peer serves the next stage" if not candidates else f"all {len(candidates)} candidates are banned"
            return Choice(None, why)
        stats = self._stats
        ready: list[tuple[str, PeerStats]] = []
        for p in usable:  # every candidate gets its statistics
            st = stats.get(p)
            if st is None:
                st = stats[p] = PeerStats()
            if st.not_ready_until <= now:
                ready.append((p, st))
        if not ready:
            ready = [(p, stats[p]) for p in usable]
        load = awaited or {}
        prior: float | None = None  # the prior of unmeasured peers, computed only if a candidate is one (O(peers known))
        # The least (expected finish, tie rank; peers rank apart), _finish and min() inlined,
        # the rank computed only on a tie of finish times (a choice scores every replica of the next stage).
        suspects, half_life, ranks = self.suspects, self.penalty_half_life_s, self._ranks
        best: str | None = None
        best_eta, best_rank = 0.0, None
        for p, st in ready:
            service = st.service_s
            if service is None:
                if prior is None:
                    prior = self._prior()
                service = prior
            q = st.reported_queue
            if st.outstanding > q:
                q = float(st.outstanding)
            a = load.get(p, 0)
            if a > q:
                q = float(a)
            eta = (q + 1.0) * service
            if st.penalty_s > 0:
                eta += st.penalty_s * 0.5 ** (max(0.0, now - st.penalty_at) / half_life)
            if p in suspects:
                eta *= SUSPECT_FACTOR
            if best is None or eta < best_eta:
                best, best_eta, best_rank = p, eta, None
            elif eta == best_eta:
                if best_rank is None:
                    best_rank = self._rank(best)
                rank = ranks.get(p)
                if rank is None:
                    rank = self._rank(p)
                if rank < best_rank:
                    best, best_rank = p, rank
        assert best is not None  # ready is never empty
        queue = self._queue(stats[best], load.get(best, 0))
        return Choice(best, "", best_eta, queue, len(usable))

    # -- observations ----------------------------------------------------------------------------
    def on_sent(self, peer: str) -> None:
        self._get(peer).outstanding += 1

    def on_done(self, peer: str, service_s: float) -> None:
        """A microbatch sent to ``peer`` came back (or was accepted) after ``service_s``."""
        st = self._get(peer)
        st.outstanding = max(0, st.outstanding - 1)
        st.not_ready = 0
        service_s = max(0.0, service_s)
        old = st.service_s
        if old is None:
            st.service_s = service_s
            self._known_n += 1
            self._known_sum += service_s
        else:
            st.service_s = (1 - self.alpha) * old + self.alpha * service_s
            self._known_sum += st.service_s - old

    def on_failure(self, peer: str, now: float) -> None:
        """The peer refused, timed out or broke the stream: penalise it for a while."""
        st = self._get(peer)
        st.outstanding = max(0, st.outstanding - 1)
        st.penalty_s = self._penalty(st, now) + self.failure_penalty_s
        st.penalty_at = now
        st.failures += 1

    def on_not_ready(self, peer: str, now: float) -> None:
        """The peer refused a microbatch of a step it has not reached yet: skip it for a while."""
        st = self._get(peer)
        st.outstanding = max(0, st.outstanding - 1)
        st.not_ready_until = now + min(NOT_READY_MAX_S, NOT_READY_S * 2 ** min(st.not_ready, 16))
        st.not_ready += 1

    # -- liveness: microbatches whose gradient must come back ------------------------------------
    def on_returned(self, peer: str, round_trip_s: float) -> None:
        """A gradient came back from ``peer``, ``round_trip_s`` after it took the microbatch."""
        rtt = max(0.0, round_trip_s)
        prev = self._round_trip_s
        self._round_trip_s = rtt if prev is None or rtt > prev else (1 - self.alpha) * prev + self.alpha * rtt
        st = self._stats.get(peer)
        if st is not None:
            st.lost = 0

    def deadline_s(self, cap_s: float) -> float:
        """How long a handed microbatch may take to come back before it counts as lost."""
        if self._round_trip_s is None:
            return cap_s
        return min(cap_s, max(self.min_deadline_s, self.overdue_factor * self._round_trip_s))

    def on_lost(self, peer: str, now: float) -> None:
        """A microbatch ``peer`` took never came back within :meth:`deadline_s`: its penalty doubles per
        loss in a row (it soon gets no more work)."""
        st = self._get(peer)
        st.lost += 1
        st.failures += 1
        st.penalty_s = self._penalty(st, now) + self.failure_penalty_s * 2 ** min(st.lost - 1, 10)
        st.penalty_at = now

    def lost(self, peer: str) -> int:
        """Microbatches handed to ``peer`` in a row that never came back."""
        st = self._stats.get(peer)
        return st.lost if st is not None else 0

    def on_queue_report(self, peer: str, queue_len: float) -> None:
        st = self._get(peer)
        st.reported_queue = (1 - self.alpha) * st.reported_queue + self.alpha * max(0.0, queue_len)

    def ban(self, peer: str) -> None:
        self._banned.add(peer)

    def forget(self, peer: str) -> None:
        """The peer left the swarm; drop its history (it may rejoin as a new node)."""
        st = self._stats.pop(peer, None)
        if st is not None and st.service_s is not None:
            self._known_n -= 1
            # The last one out leaves an exact zero, not the rounding the sum's updates left behind.
            self._known_sum = self._known_sum - st.service_s if self._known_n else 0.0
        self._ranks.pop(peer, None)
