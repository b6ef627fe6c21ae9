"""The ban policy and the per-peer rate limit."""

from __future__ import annotations

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.ratelimit import RateLimiter
from protolearn.coordinator.core.verdicts import MAX_BANS_IN_REPLY, VerdictPolicy


def policy(**kw) -> VerdictPolicy:
    return VerdictPolicy(CoordinatorSettings(reports_to_ban=3, report_window_s=60.0, **kw))


def test_verified_evidence_bans_at_once_only_where_the_policy_says_so() -> None:
    assert not policy().report("r1", "bad", "proof", evidence_verified=True, now=0.0).ban  # off by default
    v = policy(ban_on_evidence=True)
    verdict = v.report("r1", "bad", "spot check mismatch", evidence_verified=True, now=0.0)
    assert verdict.ban and v.is_banned("bad")
    assert "signed evidence from r1" in v.bans["bad"].reason


def test_bans_drain_once_and_restore_without_anything_to_persist() -> None:
    v = policy()
    v.ban("b", "operator", 1.0)
    v.ban("a", "operator", 2.0)
    assert [b.peer_id for b in v.drain()] == ["a", "b"] and v.drain() == []
    again = policy()
    again.report("r1", "c", "x", evidence_verified=False, now=0.0)
    again.restore(v.bans.values())
    assert again.is_banned("a") and again.is_banned("b") and again.drain() == [] and not again.reports


def test_evidence_ban_can_be_turned_off() -> None:
    v = policy(ban_on_evidence=False)
    assert not v.report("r1", "bad", "x", evidence_verified=True, now=0.0).ban


def test_distinct_reporters_within_the_window_ban() -> None:
    v = policy()
    assert not v.report("r1", "bad", "slow", evidence_verified=False, now=0.0).ban
    # one reporter repeating itself counts once
    assert not v.report("r1", "bad", "slow", evidence_verified=False, now=1.0).ban
    assert not v.report("r2", "bad", "slow", evidence_verified=False, now=2.0).ban
    verdict = v.report("r3", "bad", "outlier activations", evidence_verified=False, now=3.0)
    assert verdict.ban and "3 peers" in verdict.reason
    assert list(v.dirty) == ["bad"]


def test_sybil_reports_without_the_accuseds_signature_never_ban_by_default() -> None:
    # Attack 1 (issue 12): f identities are f "distinct" reporters, so by default a report without
    # evidence the accused signed is a claim that is counted, never a ban, however many Sybils send it.
    v = VerdictPolicy(CoordinatorSettings())
    for i in range(1000):
        verdict = v.report(f"sybil{i}", "honest", "slow", evidence_verified=False, now=float(i) / 1000)
        assert not verdict.ban
    assert not v.is_banned("honest") and "never bans" in verdict.reason


def test_replies_carry_only_the_newest_bans() -> None:
    v = policy()
    for i in range(MAX_BANS_IN_REPLY + 10):
        v.ban(f"p{i:06d}", "operator", float(i))
    sent = v.banned()
    assert len(sent) == MAX_BANS_IN_REPLY and "p000000" not in sent and f"p{MAX_BANS_IN_REPLY + 9:06d}" in sent
    assert v.is_banned("p000000")  # still refused by the coordinator itself


def test_reports_outside_the_window_expire() -> None:
    v = policy()
    v.report("r1", "bad", "x", evidence_verified=False, now=0.0)
    v.report("r2", "bad", "x", evidence_verified=False, now=10.0)
    verdict = v.report("r3", "bad", "x", evidence_verified=False, now=65.0)
    assert not verdict.ban and "2 of 3" in verdict.reason
    v.prune(200.0)
    assert v.reports == {}


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    rl = RateLimiter(rate=10.0, burst=5)
    assert [rl.allow("p", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert rl.allow("q", 0.0)  # other peers are unaffected
    assert not rl.allow("p", 0.05)  # half a token
    assert rl.allow("p", 0.1)
    assert rl.allow("p", 10.0) and rl.allow("p", 10.0)


def test_bucket_table_stays_bounded_under_a_flood_of_peer_ids() -> None:
    rl = RateLimiter(rate=1.0, burst=2, max_peers=100)
    for i in range(10_000):
        rl.allow(f"sybil{i}", float(i) * 0.001)
    assert len(rl) <= 100
