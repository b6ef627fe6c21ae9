"""The strict-majority rule, in one place: what a stage's majority holds is what more than half of
its voters hold. Commits, the state a joiner installs and liveness verdicts all rest on it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def is_strict_majority(count: int, total: int) -> bool:
    """Whether ``count`` votes out of ``total`` are more than half."""
    return 2 * count > total


def majority_size(total: int) -> int:
    """The fewest votes out of ``total`` that are a strict majority."""
    return total // 2 + 1


def strict_majority(votes: Iterable[T], total: int | None = None) -> T | None:
    """The value more than half of ``total`` voters cast (``total`` defaults to the votes cast), or None."""
    counts = Counter(votes)
    if not counts:
        return None
    n = sum(counts.values()) if total is None else total
    ((best, count),) = counts.most_common(1)
    return best if is_strict_majority(count, n) else None


def majority_state(reported: Iterable[tuple[int, str]]) -> tuple[int, str] | None:
    """The (step, parameter hash) that a strict majority of a stage's reporting replicas hold, or None.

    ``reported`` is each replica's (last applied step, hash after it); entries without a hash do not
    count. A liar, or a lagging replica, is one vote among the stage's reporters: alone it can neither
    pass its state off as the stage's nor hide the stage's. While the replicas are split (half of them
    a step ahead, or a real split) there is no majority, and a caller waits for the next reports. A
    stage with a single reporting replica has that replica as its majority: nobody else can vouch for
    or against it.
    """
    return strict_majority((step, h) for step, h in reported if h)
