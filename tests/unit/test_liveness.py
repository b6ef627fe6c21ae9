"""The collective's failure detector: probes every floor_s / 2, suspects a silent peer after one limit
and a peer that answers but delivers nothing after STUCK_FACTOR limits, with deadlines from the wait's start."""

from __future__ import annotations

import pytest
from protolearn.protocol.collective.liveness import STUCK_FACTOR, Bandwidth, FailureDetector, Wait


def test_a_silent_peer_is_probed_then_suspected_after_one_limit() -> None:
    d = FailureDetector(floor_s=2.0)
    d.track([("gather", 0, "b")], now=10.0)
    waits = {("gather", 0, "b"): Wait(["b"], 5.0)}
    assert d.next_deadline(waits) == pytest.approx(11.0)  # the first probe
    assert d.due(10.5, waits) == ([], set(), set())
    assert d.due(11.0, waits) == (["b"], set(), set())
    assert d.due(11.0, waits) == ([], set(), set()), "one probe per peer per instant"
    assert d.next_deadline(waits) == pytest.approx(12.0)
    assert d.due(15.0, waits) == ([], {"b"}, {"b"}), "silent for the whole limit: suspected, not probed again"


def test_a_peer_that_answers_but_never_delivers_is_suspected_after_stuck_factor_limits() -> None:
    d = FailureDetector(floor_s=2.0)
    waits = {"own": Wait(["b"], 5.0)}
    d.track(["own"], now=0.0)
    suspected_at = None
    for tick in range(1, 40):
        now = tick * 0.5
        d.alive("b", now)  # it answers every probe
        due = d.due(now, waits)
        if due.suspects:
            suspected_at = now
            break
    assert suspected_at == pytest.approx(STUCK_FACTOR * 5.0)
    assert due.silent == set(), "stuck, not silent: it answered every probe"


def test_a_stuck_peer_on_a_silence_only_wait_is_only_suspected_once_silent() -> None:
    d = FailureDetector(floor_s=2.0)
    waits = {"fin": Wait(["b"], 5.0, silence_only=True)}
    d.track(["fin"], now=0.0)
    for tick in range(1, 60):
        d.alive("b", tick * 0.5)
        assert d.due(tick * 0.5, waits).suspects == set()
        assert d.next_deadline(waits) is not None and d.next_deadline(waits) > tick * 0.5, "no deadline left in the past"
    assert d.due(29.5 + 5.0, waits) == ([], {"b"}, {"b"})


def test_a_deadline_counts_from_the_start_of_the_wait_and_restarts_with_a_new_wait() -> None:
    d = FailureDetector(floor_s=2.0)
    d.track(["w1"], now=0.0)
    d.track(["w1"], now=4.0)  # the same wait goes on: still counted from 0
    assert d.due(5.0, {"w1": Wait(["b"], 5.0)})[1] == {"b"}
    d.track(["w2"], now=5.0)  # a new wait on the same peer begins now
    assert d.wait_keys() == ["w2"]
    assert d.due(9.0, {"w2": Wait(["b"], 5.0)})[1] == set()


def test_the_limit_scales_with_the_measured_bandwidth_and_never_drops_below_the_floor() -> None:
    bw = Bandwidth(1e6)
    d = FailureDetector(floor_s=2.0, factor=4.0, bandwidth=bw)
    assert d.deadline_s(1_000_000) == pytest.approx(4.0)
    bw.observe(100_000_000, 1.0)  # the first sample replaces the guess
    assert bw.bytes_per_s == 1e8 and d.deadline_s(1_000_000) == 2.0
