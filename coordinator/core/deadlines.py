"""Notes of a time per key, oldest first: what is due without visiting everything that is not.

The registry's expiry keeps one :class:`Notes` for the live members (a time each was heard from) and one for the
departed (a time each left). A key has at most one note: noting a key that has one does nothing, so a member that
heartbeats as fast as it may still holds one note. Whoever pops a due key reads its real time (a heartbeat since
the note, a rejoin) and notes it again at that time if it is not due after all: the note moves along only when it
comes up, which costs one push per key per period instead of one per heartbeat.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator


class Notes:
    """At most one ``(time, key)`` note per key, in a heap."""

    def __init__(self, times: Iterable[tuple[str, float]] = ()) -> None:
        self._at: dict[str, float] = dict(times)
        self._heap = [(at, key) for key, at in self._at.items()]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def note(self, key: str, at: float) -> None:
        """Give ``key`` a note at ``at`` unless it has one (an older one moves on when it comes up)."""
        if key not in self._at:
            self._at[key] = at
            heapq.heappush(self._heap, (at, key))

    def due(self, now: float, after_s: float) -> Iterator[str]:
        """The keys whose note is more than ``after_s`` before ``now``, oldest first, each taken out of the notes
        as it is yielded (note it again to keep it). A key noted again during the loop comes up again only if
        its new note is due too."""
        heap, noted = self._heap, self._at
        while heap and now - heap[0][0] > after_s:
            _, key = heapq.heappop(heap)
            del noted[key]  # a key has one note, so the one popped is the one noted
            yield key
