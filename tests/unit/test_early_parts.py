"""Early collective parts: per-peer, outsider and total bounds, and the accounting's release (issue 12, attack 9)."""

from __future__ import annotations

from protolearn.node.core.early_parts import EarlyParts

V = 1000  # the stage vector's bytes


def test_a_peer_holds_at_most_twice_the_vector_and_a_few_parts() -> None:
    early: EarlyParts[str] = EarlyParts(vector_bytes=V)
    assert early.reserve("flood", 900) is None and early.reserve("flood", 900) is None
    why = early.reserve("flood", 900)
    assert why is not None and "its limit of 2000" in why and early.peer_held("flood") == 1800
    for _ in range(7):
        assert early.reserve("fins", 0) is None  # fins weigh nothing, but count as parts
    assert early.reserve("fins", 0) is None and early.reserve("fins", 0) is not None  # the 9th
    # An honest member still gets its parts in.
    assert early.reserve("honest", 500) is None


def test_non_members_share_one_vector_and_the_total_is_capped() -> None:
    early: EarlyParts[str] = EarlyParts(vector_bytes=V)
    assert early.reserve("sybil1", 600, member=False) is None
    why = early.reserve("sybil2", 600, member=False)
    assert why is not None and "not a member" in why
    for i in range(3):
        assert early.reserve(f"m{i}", 1000) is None
    assert early.held_bytes == 3600
    why = early.reserve("m3", 1000)
    assert why is not None and "exceed the limit of 4000" in why


def test_held_parts_leave_the_accounting_when_taken_or_dropped() -> None:
    early: EarlyParts[str] = EarlyParts(vector_bytes=V)
    for round_id, peer in ((5, "a"), (5, "b"), (6, "a"), (4, "c")):
        assert early.reserve(peer, 100, member=peer != "c") is None
        early.hold(round_id, peer, 100, f"{peer}{round_id}")
    early.drop_before(5)
    assert early.held_bytes == 300 and early.outsider_held == 0 and early.peer_held("c") == 0
    assert sorted(early.take(5)) == ["a5", "b5"] and early.held_bytes == 100
    assert early.take(6) == ["a6"] and early.held_bytes == 0 and early.num_parts == 0 and not early._peers
