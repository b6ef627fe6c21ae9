"""Running tallies of the live members, so that no request path scans the members (sans-IO).

The coordinator is the one component every node talks to, so its per-request work must be O(1) in the
number of members. :class:`StageTallies` keeps what requests ask about the swarm as a whole up to date as
members change: the live count, per stage the replicas, the summed throughput (a member that has not measured
its throughput yet counts as the swarm's median claim, see :meth:`StageTallies.loads`) and the working replicas
(those serving the stage now, see ``members.py``), the swarm's throughput claims (for their median, see
``assignment.py``), stage 0's corpus votes (``corpus.py``) and the live public members that offered to
relay (``reachability.py``). The registry calls :meth:`StageTallies.count` with -1 before it changes a
member in a way the tallies see, and with 1 after.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from protolearn.coordinator.core.assignment import MIN_THROUGHPUT, StageLoad, ThroughputClaims
from protolearn.coordinator.core.members import LIVE, SERVING_STATES, Member

# Stage throughput is summed in integer units of this many layer-tokens/s, so that adding and later
# subtracting a member's share leaves the sum exactly as a fresh sum would be (floats would drift).
_UNITS_PER_THROUGHPUT = 1_000_000


def _units(throughput: float) -> int:
    return round(max(throughput, MIN_THROUGHPUT) * _UNITS_PER_THROUGHPUT)


class StageTallies:
    """The live members' tallies, per stage and over the swarm; built from ``members`` (a restart)."""

    def __init__(self, num_stages: int, members: Iterable[Member] = ()) -> None:
        self.num_stages = num_stages
        self.num_live = 0
        self._replicas = [0] * num_stages
        self._working: list[set[str]] = [set() for _ in range(num_stages)]
        self._throughput = [0] * num_stages
        self._unmeasured = [0] * num_stages  # members that have claimed no throughput yet (0: not measured)
        self.claims = ThroughputClaims()
        self._corpus_votes: Counter[str] = Counter()
        # Live members that offered to relay and that the coordinator found public, in join order (a dict as
        # an ordered set): the relays a reachability reply offers, found without scanning the members.
        self.relays: dict[str, None] = {}
        for m in members:
            self.count(m, 1)

    def count(self, m: Member, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) ``m``'s part of the tallies: call with -1 before changing a
        member's status, stage, serving stage, state, throughput, corpus or relay offer, and with 1 after."""
        if m.status != LIVE:
            return
        self.num_live += sign
        self.claims.add(m.throughput, sign)
        if m.relay and m.reachability == "public":
            if sign > 0:
                self.relays[m.peer_id] = None
            else:
                self.relays.pop(m.peer_id, None)
        s = m.stage
        if s == 0 and m.corpus:
            self._corpus_votes[m.corpus] += sign
            if not self._corpus_votes[m.corpus]:
                del self._corpus_votes[m.corpus]
        if not 0 <= s < self.num_stages:
            return
        self._replicas[s] += sign
        if m.throughput > 0:
            self._throughput[s] += sign * _units(m.throughput)
        else:
            self._unmeasured[s] += sign
        if m.serving in (-1, s) and m.state in SERVING_STATES:
            if sign > 0:
                self._working[s].add(m.peer_id)
            else:
                self._working[s].discard(m.peer_id)

    def working_peers(self, stage: int) -> set[str]:
        """The members that serve ``stage`` now and train (a member still moving there does not count)."""
        return self._working[stage] if 0 <= stage < self.num_stages else set()

    def working_counts(self) -> list[int]:
        """How many members work in each stage, in stage order."""
        return [len(w) for w in self._working]

    def could_rebalance(self, shares: Sequence[float], min_quality: float) -> bool:
        """False only when :func:`~.assignment.propose_move` over the live members would propose no move: the
        bottleneck stage's rate is already at least ``min_quality`` times the best any move could reach (the
        share-weighted mean rate, which no stage's rate after a move can all exceed). The bounds are widened by
        the integer units' rounding, so this never says False where the scan finds a move. It saves the
        registry's once-a-second scan of every member while the stages stay balanced."""
        if self.num_stages < 2:
            return False
        lowest, total = float("inf"), 0.0
        for t, u, n, w in zip(self._throughput, self._unmeasured, self._replicas, shares, strict=True):
            thr = t / _UNITS_PER_THROUGHPUT + u * MIN_THROUGHPUT  # as stage_loads counts an unmeasured member
            slack = n / _UNITS_PER_THROUGHPUT + 1e-9 * thr
            lowest = min(lowest, (thr - slack) / w)
            total += thr + slack
        return lowest < min_quality * total / sum(shares)

    def loads(self) -> list[StageLoad]:
        """Each stage's summed throughput and replica count, as :func:`~.assignment.stage_loads` would give, except that
        a member that has not measured its throughput yet (a joiner until its first heartbeat that says) counts as the
        swarm's lower median claim: counted as nothing, it left its stage the least loaded, so joiners that came
        within one heartbeat of each other all went there (4 equal nodes joining a 2-stage run as two trained split
        3 to 1). A claim of 0 gains nothing over claiming the median (claims count up to ``throughput_claim_factor``
        times it, assignment.py)."""
        typical = max(self.claims.lower_median() or 0.0, MIN_THROUGHPUT)
        return [StageLoad(t / _UNITS_PER_THROUGHPUT + u * typical, n)
                for t, u, n in zip(self._throughput, self._unmeasured, self._replicas, strict=True)]

    def corpus_votes(self, fingerprint: str) -> int:
        """How many live stage-0 members reported ``fingerprint``."""
        return self._corpus_votes.get(fingerprint, 0)
