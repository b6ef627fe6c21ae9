"""Which peer of the next stage gets the next microbatch: least expected finish time.

A sans-IO core. For every candidate peer it keeps exponential moving averages of how long a
microbatch takes there (service time, measured from send to the peer's answer) and of the queue the
peer reports, plus the microbatches this node has outstanding with it. The expected finish time of
one more microbatch is::

    (max(reported_queue, outstanding) + 1) * service_time_ema + failure_penalty

A failure adds a penalty that decays over ``penalty_half_life_s``, so a flaky peer is avoided for a
while and then tried again; a banned peer is never chosen. Ties go to the smaller peer id, so the
choice is deterministic for a given history. :meth:`Balancer.choose` returns the peer and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# With no measurement yet, a peer is assumed as fast as the average known peer, or this.
DEFAULT_SERVICE_S = 0.05
EMA_ALPHA = 0.3
FAILURE_PENALTY_S = 5.0
PENALTY_HALF_LIFE_S = 10.0


@dataclass(frozen=True)
class Choice:
    """The chosen peer (``None`` when no candidate is usable) and why."""

    peer: str | None
    reason: str
    expected_s: float = float("inf")


@dataclass
class PeerStats:
    service_s: float | None = None
    reported_queue: float = 0.0
    outstanding: int = 0
    penalty_s: float = 0.0
    penalty_at: float = 0.0
    failures: int = 0


@dataclass
class Balancer:
    """Least-expected-finish-time choice among the peers of one downstream (or upstream) stage."""

    alpha: float = EMA_ALPHA
    failure_penalty_s: float = FAILURE_PENALTY_S
    penalty_half_life_s: float = PENALTY_HALF_LIFE_S
    default_service_s: float = DEFAULT_SERVICE_S
    _stats: dict[str, PeerStats] = field(default_factory=dict)
    _banned: set[str] = field(default_factory=set)

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
        known = [s.service_s for s in self._stats.values() if s.service_s is not None]
        return sum(known) / len(known) if known else self.default_service_s

    def expected_finish_s(self, peer: str, now: float) -> float:
        st = self._get(peer)
        service = st.service_s if st.service_s is not None else self._prior()
        queue = max(st.reported_queue, float(st.outstanding))
        return (queue + 1.0) * service + self._penalty(st, now)

    # -- decisions -------------------------------------------------------------------------------
    def choose(self, candidates: list[str], now: float) -> Choice:
        usable = sorted(set(candidates) - self._banned)
        if not usable:
            why = "no peer serves the next stage" if not candidates else f"all {len(candidates)} candidates are banned"
            return Choice(None, why)
        best = min(usable, key=lambda p: (self.expected_finish_s(p, now), p))
        eta = self.expected_finish_s(best, now)
        st = self._get(best)
        return Choice(best, f"least expected finish {eta:.3f} s (queue {max(st.reported_queue, st.outstanding):.0f}, of {len(usable)} peers)", eta)

    # -- observations ----------------------------------------------------------------------------
    def on_sent(self, peer: str) -> None:
        self._get(peer).outstanding += 1

    def on_done(self, peer: str, service_s: float) -> None:
        """A microbatch sent to ``peer`` came back (or was accepted) after ``service_s``."""
        st = self._get(peer)
        st.outstanding = max(0, st.outstanding - 1)
        service_s = max(0.0, service_s)
        st.service_s = service_s if st.service_s is None else (1 - self.alpha) * st.service_s + self.alpha * service_s

    def on_failure(self, peer: str, now: float) -> None:
        """The peer refused, timed out or broke the stream: penalise it for a while."""
        st = self._get(peer)
        st.outstanding = max(0, st.outstanding - 1)
        st.penalty_s = self._penalty(st, now) + self.failure_penalty_s
        st.penalty_at = now
        st.failures += 1

    def on_queue_report(self, peer: str, queue_len: float) -> None:
        st = self._get(peer)
        st.reported_queue = (1 - self.alpha) * st.reported_queue + self.alpha * max(0.0, queue_len)

    def ban(self, peer: str) -> None:
        self._banned.add(peer)

    def forget(self, peer: str) -> None:
        """The peer left the swarm; drop its history (it may rejoin as a new node)."""
        self._stats.pop(peer, None)
