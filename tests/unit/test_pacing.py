"""Heartbeat pacing (coordinator/core/pacing.py): the interval grows with the swarm, replies carry it, and
expiry follows it without ever expiring a member that beats at the interval it was told."""

from __future__ import annotations

import random

import pytest
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.pacing import Pacing
from protolearn.protocol import coordination as cm
from tests.support.coordinator import join, make_core

# 10 heartbeats a second at most: past 10 members the interval grows; expiry is 3 intervals.
PACED = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=3.0, max_heartbeats_per_s=10.0, max_heartbeat_interval_s=30.0,
                            rate_per_s=1000, rate_burst=1000, restart_grace_s=0.0)


def test_the_interval_is_the_base_until_the_rate_is_reached_then_grows_with_the_members_up_to_the_ceiling() -> None:
    p = Pacing(PACED)
    assert [p.target_s(n) for n in (0, 5, 10, 11, 25, 100, 299, 10_000)] == [1.0, 1.0, 1.0, 1.1, 2.5, 10.0, 29.9, 30.0]
    assert Pacing(PACED.model_copy(update={"max_heartbeats_per_s": None})).target_s(10_000) == 1.0
    p.update(100, 0.0)
    assert (p.interval_s, p.expiry_s) == (10.0, 30.0)


def test_the_interval_rises_at_once_and_falls_at_a_bounded_pace() -> None:
    p = Pacing(PACED)
    assert p.update(200, 0.0) == 20.0
    fall = (1 - 1 / 3) / 2  # per second, at 3 intervals of expiry
    assert p.update(10, 10.0) == pytest.approx(20.0 - 10 * fall)
    assert p.update(10, 1000.0) == 1.0  # it reaches the target, never below
    assert p.update(50, 1000.0) == 5.0


def test_join_and_heartbeat_replies_carry_the_interval_and_a_silent_member_expires_after_that_many_intervals() -> None:
    core = make_core(settings=PACED)
    replies = [join(core, f"p{i:02d}") for i in range(40)]
    assert replies[0].heartbeat_interval_s == 1.0 and replies[-1].heartbeat_interval_s == 4.0
    assert replies[-1].expiry_s == 12.0
    beat = core.handle("p00", cm.Heartbeat(state="training"), 1.0)
    assert isinstance(beat, cm.HeartbeatReply) and beat.heartbeat_interval_s == 4.0
    # Every member but p00 beats at 10 s; p00, told 4 s at t=1, stays silent. The settings' own expiry
    # (3 s) would have expired everyone by t=10; at 4 s intervals only the one silent for 3 of them goes.
    for i in range(1, 40):
        core.handle(f"p{i:02d}", cm.Heartbeat(state="training"), 10.0)
    assert core.housekeeping(10.0) == [] and core.registry.num_live == 40
    assert [e.split()[1] for e in core.housekeeping(13.5) if e.startswith("expired")] == ["peer=p00"]


@pytest.mark.parametrize("seed", range(20))
def test_members_that_beat_at_the_interval_they_were_told_never_expire_while_the_swarm_shrinks(seed: int) -> None:
    """A fake-clock swarm of 120 paced members where random members leave (up to all but 5 at once); each
    member that stays beats exactly at the last interval it was told, late by up to 5 %. None may expire."""
    rng = random.Random(seed)
    print(f"seed={seed}")
    core = make_core(settings=PACED)
    now = 0.0
    due: dict[str, float] = {}  # when each member beats next: the interval it was told, up to 5 % late
    for i in range(120):
        r = join(core, f"m{i:03d}", now)
        due[f"m{i:03d}"] = now + r.heartbeat_interval_s * (1 + 0.05 * rng.random())
    leave_at = sorted(rng.uniform(1.0, 60.0) for _ in range(rng.randint(1, 4)))
    while now < 120.0:
        now += 0.25
        if leave_at and now >= leave_at[0]:
            leave_at.pop(0)
            stay = rng.randint(5, max(5, len(due) // 2))
            for p in rng.sample(sorted(due), len(due) - stay):
                core.handle(p, cm.Leave(reason="test"), now)
                del due[p]
        for p, t in sorted(due.items()):
            if now >= t:
                reply = core.handle(p, cm.Heartbeat(state="training"), now)
                assert isinstance(reply, cm.HeartbeatReply)
                due[p] = now + reply.heartbeat_interval_s * (1 + 0.05 * rng.random())
        expired = [e for e in core.housekeeping(now) if e.startswith("expired")]
        assert not expired, (now, expired, core.pacing.interval_s)
    # 60 s after the last departure it has fallen to what the members left ask for.
    assert core.pacing.interval_s == core.pacing.target_s(core.registry.num_live) < 12.0
