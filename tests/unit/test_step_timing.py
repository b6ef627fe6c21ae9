"""The node's step timer on a fake clock: every second of a step lands in exactly one part, compute
before transfer before the bubble, and the event says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing
from protolearn.node.progress import Progress
from protolearn.node.step_timing import StepTimer, timed_transfer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, s: float) -> None:
        self.now += s


def _events(path: Path) -> list[dict]:
    return [d for d in map(json.loads, path.read_text().splitlines()) if d["event"] == "step_times"]


def test_a_step_splits_into_its_parts(tmp_path: Path) -> None:
    clock = Clock()
    with Progress(tmp_path / "n.jsonl", name="n", live=False) as p:
        t = StepTimer(p, clock)
        t.begin(3)
        t.phase("train")
        clock.tick(0.5)  # waiting for the other stage: bubble
        with t.transfer():
            clock.tick(0.2)  # sending only
            t._busy("compute", 1)
            clock.tick(1.0)  # computing while the transfer runs: compute wins
            t._busy("compute", -1)
            clock.tick(0.1)
        clock.tick(0.3)  # bubble again
        t.phase("averaging")
        with t.transfer():  # the collective's traffic is averaging, not boundary transfer
            clock.tick(0.7)
        t.phase("commit")
        clock.tick(0.4)
        t.phase("apply")
        t._busy("compute", 1)
        clock.tick(0.05)
        t._busy("compute", -1)
        t.phase("other")
        clock.tick(0.01)
        t.end(3)
    (e,) = _events(tmp_path / "n.jsonl")
    assert e["step"] == 3 and e["rounds"] == 1
    assert e["bubble_s"] == pytest.approx(0.8)
    assert e["transfer_s"] == pytest.approx(0.3)
    assert e["transfer_busy_s"] == pytest.approx(1.3)
    assert e["apply_s"] == pytest.approx(0.05)
    assert e["compute_s"] == pytest.approx(1.05)  # the train phase's compute plus the optimizer step
    assert (e["averaging_s"], e["commit_s"], e["other_s"]) == pytest.approx((0.7, 0.4, 0.01))
    parts = e["compute_s"] + e["transfer_s"] + e["bubble_s"] + e["averaging_s"] + e["commit_s"] + e["other_s"]
    assert parts == pytest.approx(e["wall_s"])


def test_a_reopened_step_sums_its_rounds(tmp_path: Path) -> None:
    clock = Clock()
    with Progress(tmp_path / "n.jsonl", name="n", live=False) as p:
        t = StepTimer(p, clock)
        t.begin(0)
        for _ in range(2):
            t.phase("train")
            clock.tick(1.0)
            t.phase("averaging")
            clock.tick(0.5)
        t.end(0)
        t.end(0)  # a second end of the same step writes nothing
        t.phase("train")  # between steps: nothing to book
    (e,) = _events(tmp_path / "n.jsonl")
    assert (e["rounds"], e["bubble_s"], e["averaging_s"], e["wall_s"]) == pytest.approx((2, 2.0, 1.0, 3.0))


def test_the_limiter_counts_held_time_as_compute(tmp_path: Path) -> None:
    class Worker:
        def __init__(self, timing: StepTimer) -> None:
            self.timing = timing

        @timed_transfer
        async def send(self) -> str:
            await trio.sleep(0.3)
            return "sent"

    async def main() -> None:
        with Progress(tmp_path / "n.jsonl", name="n", live=False) as p:
            t = StepTimer(p, trio.current_time)
            limiter = t.limiter(trio.CapacityLimiter(1))
            t.begin(1)
            t.phase("train")
            assert await trio.to_thread.run_sync(lambda: 7, limiter=limiter) == 7  # takes and gives back the token
            async with limiter:
                await trio.sleep(1.0)
            assert await Worker(t).send() == "sent"
            await trio.sleep(0.2)
            t.end(1)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (e,) = _events(tmp_path / "n.jsonl")
    assert e["compute_s"] == pytest.approx(1.0)
    assert e["transfer_s"] == pytest.approx(0.3)
    assert e["bubble_s"] == pytest.approx(0.2)
