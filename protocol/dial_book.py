"""Which peers a host failed to dial lately, and whether to dial them again yet (sans IO).

A replica that dies stays in the coordinator's view until its heartbeats expire (``expiry_s``, 5 s by
default). Meanwhile every caller of the node that wants it dials it again: a spot check asking it to
recompute a neighbour's output, a gradient on its way back, a collective probe, a state request. Each
dial of a dead peer costs py-libp2p's refused TCP attempts, and one ERROR line for each; a neighbour
that spot-checked every activation logged about ten a second until the coordinator spoke.

:class:`DialBook` lets a host dial a peer freely until ``max_failures`` dials in a row have failed;
from then on it allows one trial dial per back-off (``first_backoff_s``, doubling up to
``max_backoff_s``) and refuses the others at once, with the reason. A refusal is a
:class:`~protolearn.protocol.errors.PeerUnavailable` like a failed dial, so callers already handle it;
it just costs nothing. The record of a peer is dropped, and the next dial goes at once, when:

- a dial of it succeeds, or it connects to this host (it is alive);
- the addresses this host is told for it change (it rejoined elsewhere);
- the coordinator's view no longer holds it (:meth:`DialBook.retain`): when it joins again, it is a
  new member, whatever its address.

So a dead peer is dialled ``max_failures`` times, then about once per back-off, until its neighbours
hear the coordinator's word. The book reads no clock (``now`` is passed in), does no IO and holds at
most ``max_peers`` records (the oldest are forgotten first).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# Dials in a row that may fail before the back-off starts.
MAX_FAILURES = 2
# The first back-off after MAX_FAILURES failures, and the most it doubles to (seconds). With the
# coordinator's default expiry of 5 s, a dead peer is dialled about four times before the view drops it.
FIRST_BACKOFF_S = 2.0
MAX_BACKOFF_S = 16.0
# Peers with a record kept at once.
MAX_PEERS = 4096


@dataclass
class _Record:
    failures: int = 0
    # No dial before this time (meaningful once failures >= max_failures).
    next_at: float = 0.0
    reason: str = ""
    last_at: float = 0.0


class DialBook:
    """Failed dials per peer, and the back-off they earn. See the module docstring."""

    def __init__(self, *, max_failures: int = MAX_FAILURES, first_backoff_s: float = FIRST_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, max_peers: int = MAX_PEERS) -> None:
        if max_failures < 1 or first_backoff_s <= 0 or max_backoff_s < first_backoff_s or max_peers < 1:
            raise ValueError(
                f"DialBook needs max_failures >= 1, 0 < first_backoff_s <= max_backoff_s and max_peers >= 1; got "
                f"max_failures={max_failures}, first_backoff_s={first_backoff_s}, max_backoff_s={max_backoff_s}, max_peers={max_peers}"
            )
        self.max_failures = max_failures
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_peers = max_peers
        self._records: dict[str, _Record] = {}
        # Dials refused because of a back-off, in all (for tests and metrics).
        self.num_refused = 0

    def refusal(self, peer: str, now: float) -> str | None:
        """None: dial ``peer`` now. Otherwise the reason not to, and the dial is counted as refused.

        Once the back-off has passed, one caller gets the trial dial; others that ask before its
        outcome (:meth:`failed` or :meth:`succeeded`) is known are refused for one more back-off."""
        r = self._records.get(peer)
        if r is None or r.failures < self.max_failures:
            return None
        if now >= r.next_at:
            r.next_at = now + self._backoff(r.failures)  # the trial's outcome replaces this
            return None
        self.num_refused += 1
        return (
            f"not dialling it: its last {r.failures} dials failed, the last {now - r.last_at:.1f} s ago ({r.reason}); "
            f"next try in {r.next_at - now:.1f} s, or as soon as it connects or the coordinator's view of it changes"
        )

    def failed(self, peer: str, now: float, reason: str) -> None:
        """A dial of ``peer`` failed (refused, unreachable, or no connection within its deadline)."""
        r = self._records.pop(peer, None) or _Record()
        self._records[peer] = r  # the most recent at the end: dicts keep insertion order
        r.failures += 1
        r.reason, r.last_at = reason, now
        if r.failures >= self.max_failures:
            r.next_at = now + self._backoff(r.failures)
        while len(self._records) > self.max_peers:
            del self._records[next(iter(self._records))]

    def succeeded(self, peer: str) -> None:
        """``peer`` is reachable: a dial of it succeeded, or it connected to this host."""
        self._records.pop(peer, None)

    forget = succeeded  # its addresses changed: whatever failed before says nothing of the new ones

    def retain(self, peers: Collection[str]) -> None:
        """Keep only the records of ``peers`` (the coordinator's view): one that left and joins again
        is dialled at once."""
        for peer in [p for p in self._records if p not in peers]:
            del self._records[peer]

    def failures(self, peer: str) -> int:
        """Dials of ``peer`` that failed in a row (0: none, or forgotten)."""
        r = self._records.get(peer)
        return 0 if r is None else r.failures

    def _backoff(self, failures: int) -> float:
        doublings = min(failures - self.max_failures, 32)  # 2**32 * any positive first back-off exceeds the cap
        return min(self.max_backoff_s, self.first_backoff_s * 2.0**doublings)

    def __len__(self) -> int:
        return len(self._records)


__all__ = ["FIRST_BACKOFF_S", "MAX_BACKOFF_S", "MAX_FAILURES", "MAX_PEERS", "DialBook"]
