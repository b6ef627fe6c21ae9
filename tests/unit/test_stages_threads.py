"""train-local's default torch threads: two on a quiet machine, one when the other cores are busy."""

from __future__ import annotations

from protolearn.cli.local import default_threads


def test_default_threads_backs_off_on_a_busy_two_core_box() -> None:
    assert default_threads(2, 0.1) == 2  # quiet 2-core box: both cores
    assert default_threads(2, 0.8) == 1  # one core already busy: don't spin-wait against it
    assert default_threads(2, 4.0) == 1
    assert default_threads(1, 0.0) == 1
    assert default_threads(16, 3.0) == 2  # a big box: capped at two
