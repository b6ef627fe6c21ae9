"""The coordinator's long-poll slots, shared so that a peer that waits little is never shut out (sans-IO).

A long poll (``coord.wait_step``) holds one of ``limit`` slots while it waits, bounding the tasks and streams that
waiting costs the coordinator (``CoordinatorSettings.max_concurrent_waits``). Before, a poll that found every slot
taken was refused ``busy``, whoever held them: a few Sybil members that each hold the transport's 16 streams a
peer may open, with polls that no step change answers, kept every honest replica's "has the step closed?" and
"did it reopen?" unanswered for as long as they liked (the abuse bench's ``long_poll_slots``: an honest step took
30 s instead of 0.3 s). A node never reads ``busy`` as an answer (``node/coordinator_link.py`` asks again), so
nothing went wrong but time; still, training stopped.

The rule now: when every slot is taken, a peer that holds fewer waits than the busiest waiting peer takes that
peer's oldest wait's slot, if that wait has lasted at least :data:`MIN_AGE_S` or its holder holds more waits than
a node ever does (:data:`NODE_WAITS`): that wait is answered at once, as at its timeout, with the step as it
stands. A long poll's answer may always come before what it waits for (at its
timeout), and every caller asks again when it is not what it waits for, so an early answer costs its holder one
request and misleads nobody. Only an asker that holds at least as many waits as every waiting peer, or whose
would-be victim holds no more than a node and has waited less than :data:`MIN_AGE_S`, is refused ``busy``. So
whoever holds the most waits gives slots up first: a node, which waits on one or two things at a time, gets a
slot at once while some peer holds more than that, and within about :data:`MIN_AGE_S` otherwise. (The age
guard alone once let Sybils that re-asked at once keep the busiest's oldest wait young: an honest replica was
refused several times in a row, its backoff grew, and it held a commit past its grace, twice, under the abuse
bench's ``long_poll_slots``.) and a Sybil that took a slot back from another Sybil holds no
more than it did. :data:`MIN_AGE_S` is longer than a node's shortest poll ("did the step reopen?", 0.5 s,
``node/finishing.py``), so such a question is never cut short, and a wait is taken over at most once per
:data:`MIN_AGE_S`.

O(1) per wait but for finding the busiest peer, O(distinct wait counts) (at most the per-peer stream cap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A wait younger than this is never ended for another peer, while its holder holds no more than NODE_WAITS
# (see the module docstring).
MIN_AGE_S = 1.0
# The most long polls a node holds at once (its next step's wait, and its reopen and commit waits of the step it
# finishes: node/node.py, node/finishing.py, node/coordinator_link.py).
NODE_WAITS = 3


@dataclass(frozen=True)
class Taken:
    """A slot for a new wait: its token, and the token of the wait whose slot it took (to be answered now), or None."""

    token: int
    ended: int | None = None


@dataclass
class WaitSlots:
    limit: int
    min_age_s: float = MIN_AGE_S
    _next: int = 0
    # peer -> its waits, oldest first: (token, when it began)
    _by_peer: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    # how many waits -> the peers holding that many (a dict as an ordered set)
    _by_count: dict[int, dict[str, None]] = field(default_factory=dict)
    _owner: dict[int, str] = field(default_factory=dict)

    @property
    def taken(self) -> int:
        """How many waits hold a slot now."""
        return len(self._owner)

    def holds(self, peer: str) -> int:
        """How many waits ``peer`` holds now."""
        return len(self._by_peer.get(peer, ()))

    def take(self, peer: str, now: float) -> Taken | None:
        """A slot for a new wait of ``peer`` at ``now``; None when it must be refused ``busy``."""
        ended = None
        if len(self._owner) >= self.limit:
            busiest = self._busiest()
            if busiest is None or self.holds(busiest) <= self.holds(peer):
                return None
            token, began = self._by_peer[busiest][0]
            if now - began < self.min_age_s and self.holds(busiest) <= NODE_WAITS:
                return None
            self.release(token)
            ended = token
        token = self._next
        self._next += 1
        self._count(peer, +1)
        self._by_peer.setdefault(peer, deque()).append((token, now))
        self._owner[token] = peer
        return Taken(token, ended)

    def release(self, token: int) -> None:
        """The wait ``token`` ended (answered, timed out, gone, or its slot taken): its slot is free."""
        peer = self._owner.pop(token, None)
        if peer is None:
            return
        waits = self._by_peer[peer]
        self._count(peer, -1)
        waits.remove(next(w for w in waits if w[0] == token))
        if not waits:
            del self._by_peer[peer]

    def _count(self, peer: str, delta: int) -> None:
        """Move ``peer`` from its current count's set to the count after ``delta`` (called before its waits change)."""
        n = self.holds(peer)
        if n:
            peers = self._by_count[n]
            del peers[peer]
            if not peers:
                del self._by_count[n]
        if n + delta:
            self._by_count.setdefault(n + delta, {})[peer] = None

    def _busiest(self) -> str | None:
        """The peer holding the most waits (of those, the one that got to that many first)."""
        if not self._by_count:
            return None
        return next(iter(self._by_count[max(self._by_count)]))
