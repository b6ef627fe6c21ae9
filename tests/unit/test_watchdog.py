"""The compute watchdog's rule (node/core/watchdog.py), on a fake clock."""

from __future__ import annotations

import pytest
from protolearn.node.core.watchdog import Watchdog


def _trained(dog: Watchdog, kind: str, durations: list[float], start: float = 0.0) -> float:
    now = start
    for d in durations:
        token = dog.started(kind, now)  # type: ignore[arg-type]
        now += d
        dog.finished(token, now)
    return now


def test_a_first_call_gets_the_start_up_bound_not_a_hang_verdict() -> None:
    dog = Watchdog(first_s=60.0)
    dog.started("forward", 0.0)
    assert dog.overdue(59.0) is None
    late = dog.overdue(61.0)
    assert late is not None and late.kind == "forward" and late.median_s is None and late.bound_s == 60.0


def test_the_bound_is_ten_medians_and_never_under_the_floor() -> None:
    dog = Watchdog(factor=10.0, floor_s=5.0)
    now = _trained(dog, "forward", [0.3, 0.2, 0.4, 0.3])
    assert dog.bound("forward") == 5.0  # 10 × 0.3 s is under the floor
    now = _trained(dog, "backward", [1.0, 1.2, 0.9], now)
    assert dog.bound("backward") == pytest.approx(10.0)
    dog.started("backward", now)
    assert dog.overdue(now + 9.9) is None
    late = dog.overdue(now + 10.5)
    assert late is not None and late.kind == "backward" and late.median_s == pytest.approx(1.0)


def test_a_call_that_returns_in_the_end_is_no_longer_overdue_and_counts() -> None:
    dog = Watchdog(floor_s=1.0, window=4)
    now = _trained(dog, "optimizer", [0.1, 0.1, 0.1])
    token = dog.started("optimizer", now)
    assert dog.overdue(now + 2.0) is not None
    dog.finished(token, now + 2.0)
    assert dog.overdue(now + 50.0) is None
    # The slow call is one sample of the window; the window forgets the oldest.
    _trained(dog, "optimizer", [0.1, 0.1, 0.1], now + 2.0)
    assert dog.median("optimizer") == pytest.approx(0.1)


def test_the_worst_of_several_running_calls_is_named_and_the_next_deadline_is_the_earliest() -> None:
    dog = Watchdog(floor_s=1.0)
    now = _trained(dog, "forward", [0.1] * 3)
    now = _trained(dog, "backward", [0.5] * 3, now)
    dog.started("forward", now)       # bound 1 s
    dog.started("backward", now)      # bound 5 s
    assert dog.next_deadline() == pytest.approx(now + 1.0)
    late = dog.overdue(now + 7.0)
    assert late is not None and late.kind == "forward"  # 6 s past its bound, the backward 2 s past its own


def test_the_exit_line_names_the_stage_the_time_and_what_to_do() -> None:
    dog = Watchdog(floor_s=1.0)
    now = _trained(dog, "forward", [0.3] * 5)
    dog.started("forward", now)
    late = dog.overdue(now + 42.0)
    assert late is not None
    assert late.line(0) == ("stage 0 compute (forward) has not returned for 42 s (median 0.3 s): "
                            "the device may be hung; restart the node")


def test_bounds_that_do_not_hold_together_are_refused() -> None:
    with pytest.raises(ValueError):
        Watchdog(first_s=1.0, floor_s=5.0)
    with pytest.raises(ValueError):
        Watchdog(factor=0.5)


def test_time_the_whole_process_was_stopped_is_no_calls_fault() -> None:
    dog = Watchdog(factor=10.0, floor_s=5.0)
    now = _trained(dog, "forward", [0.1, 0.1, 0.1])
    dog.started("forward", now)
    dog.suspended(30.0)  # SIGSTOP for 30 s while the call ran
    assert dog.overdue(now + 31.0) is None
    assert dog.overdue(now + 36.0) is not None
