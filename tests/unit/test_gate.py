"""The gate's per-peer policy, sans-IO with an injected ``now``: stream limits per peer and in total,
temporary bans for repeated abuse, and their expiry (issue 12, attack 2)."""

from __future__ import annotations

import pytest

from protolearn.protocol.gate import BANNED, STREAM_LIMIT, Abuse, Gate


def test_one_peer_is_capped_per_protocol_while_others_still_get_in() -> None:
    gate = Gate(abuse=Abuse(threshold=1000))
    for _ in range(4):
        assert gate.admit_stream("attacker", "coord", limit=10, peer_limit=4, now=0.0) is None
    refused = gate.admit_stream("attacker", "coord", limit=10, peer_limit=4, now=0.0)
    assert refused is not None and refused.kind == STREAM_LIMIT and refused.peer == "attacker"
    assert "peer over its limit of 4" in refused.reason
    # Another protocol and another peer are counted apart.
    assert gate.admit_stream("attacker", "collective", limit=10, peer_limit=4, now=0.0) is None
    assert gate.admit_stream("honest", "coord", limit=10, peer_limit=4, now=0.0) is None
    assert gate.active_streams("coord") == 5 and gate.active_streams("coord", "attacker") == 4
    assert gate.rejected[STREAM_LIMIT] == 1 and gate.recent[-1] == refused
    # A released stream frees the peer's slot; the table forgets a peer with nothing open.
    gate.release_stream("attacker", "coord")
    assert gate.admit_stream("attacker", "coord", limit=10, peer_limit=4, now=0.0) is None
    gate.release_stream("honest", "coord")
    assert gate.active_streams("coord", "honest") == 0 and ("coord", "honest") not in gate._active_peer


def test_the_total_limit_still_holds_across_peers() -> None:
    gate = Gate(abuse=Abuse(threshold=1000))
    for i in range(6):
        assert gate.admit_stream(f"p{i}", "coord", limit=6, peer_limit=2, now=0.0) is None
    refused = gate.admit_stream("p7", "coord", limit=6, peer_limit=2, now=0.0)
    assert refused is not None and refused.kind == STREAM_LIMIT and "over the limit of 6" in refused.reason


def test_repeated_limit_rejections_ban_a_peer_for_a_while_and_the_ban_expires_on_its_own() -> None:
    banned: list[str] = []
    gate = Gate(abuse=Abuse(window_s=10.0, threshold=5, ban_s=30.0), on_ban=banned.append)
    assert gate.admit_stream("attacker", "coord", limit=100, peer_limit=1, now=0.0) is None
    for i in range(4):
        gate.admit_stream("attacker", "coord", limit=100, peer_limit=1, now=1.0 + i)
    assert banned == [] and not gate.is_banned("attacker", 5.0)
    gate.admit_stream("attacker", "coord", limit=100, peer_limit=1, now=5.0)  # the 5th within 10 s
    assert banned == ["attacker"] and gate.is_banned("attacker", 5.0)
    assert not gate.is_banned("attacker")  # without a time only permanent bans count
    refused = gate.admit_stream("attacker", "coord", limit=100, peer_limit=1, now=20.0)
    assert refused is not None and refused.kind == BANNED and "temporarily banned for 30 s" in refused.reason
    conn = gate.check_connection("attacker", 20.0)
    assert conn is not None and conn.kind == BANNED
    # Others were never affected.
    assert gate.admit_stream("honest", "coord", limit=100, peer_limit=1, now=20.0) is None
    # The ban ends at 35 s, and the refusals while banned did not extend it.
    assert gate.is_banned("attacker", 34.9) and not gate.is_banned("attacker", 35.0)
    assert gate.check_connection("attacker", 35.0) is None
    gate.release_stream("attacker", "coord")
    assert gate.admit_stream("attacker", "coord", limit=100, peer_limit=1, now=35.0) is None
    assert gate.abuse.num_bans == 1 and banned == ["attacker"]


def test_rejections_spread_wider_than_the_window_never_ban() -> None:
    gate = Gate(abuse=Abuse(window_s=10.0, threshold=3, ban_s=30.0))
    for t in range(0, 100, 6):  # one every 6 s: at most two in any 10 s
        gate.reject("slowpoke", "coord", "PeerTimeout", "no complete message", float(t))
    assert not gate.is_banned("slowpoke", 100.0) and gate.abuse.num_bans == 0


def test_malformed_input_is_refused_but_not_counted_as_abuse() -> None:
    gate = Gate(abuse=Abuse(window_s=10.0, threshold=3, ban_s=30.0))
    for _ in range(50):
        gate.reject("noisy", "coord", "ProtocolError", "bad msgpack", 1.0)
    assert not gate.is_banned("noisy", 1.0)
    for kind in ("OverLimit", "PeerTimeout", STREAM_LIMIT):
        gate.reject("hog", "collective", kind, "over", 2.0)
    assert gate.is_banned("hog", 2.0)


def test_a_banned_peer_comes_back_and_is_banned_again() -> None:
    gate = Gate(abuse=Abuse(window_s=10.0, threshold=2, ban_s=5.0))
    for t in (0.0, 1.0):
        gate.reject("p", "x", STREAM_LIMIT, "over", t)
    assert gate.is_banned("p", 1.0)
    for t in (7.0, 8.0):
        gate.reject("p", "x", STREAM_LIMIT, "over", t)
    assert gate.is_banned("p", 8.0) and gate.abuse.num_bans == 2


def test_a_permanent_ban_outlives_any_temporary_one() -> None:
    gate = Gate()
    gate.ban("p", "signed two stories")
    assert gate.is_banned("p") and gate.is_banned("p", 1e9) and gate.ban_reason("p", 1e9) == "signed two stories"


def test_the_abuse_tables_are_bounded() -> None:
    abuse = Abuse(window_s=100.0, threshold=2, ban_s=1000.0, max_peers=8)
    for i in range(1000):
        abuse.note(f"sybil{i}", STREAM_LIMIT, float(i) / 100)
        abuse.note(f"sybil{i}", STREAM_LIMIT, float(i) / 100)
    assert len(abuse._times) <= 8 and len(abuse._bans) <= 8 and abuse.num_bans == 1000


def test_bad_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold 0"):
        Abuse(threshold=0)


def test_unknown_peers_share_a_part_of_the_slots_so_sybils_cannot_crowd_known_peers_out() -> None:
    gate = Gate(abuse=Abuse(threshold=1000))
    for i in range(4):  # four Sybils, each within its own limit of 2
        for _ in range(2):
            gate.admit_stream(f"sybil{i}", "collective", limit=8, peer_limit=2, now=0.0, outsider=True, outsider_limit=4)
    assert gate.active_streams("collective") == 4
    refused = [r for r in gate.recent if r.kind == STREAM_LIMIT]
    assert len(refused) == 4 and "unknown peers hold their limit of 4" in refused[0].reason
    for peer in ("member1", "member2"):
        for _ in range(2):
            assert gate.admit_stream(peer, "collective", limit=8, peer_limit=2, now=0.0) is None
    # A Sybil's stream ending frees one outsider slot, and only that.
    gate.release_stream("sybil0", "collective")
    assert gate.admit_stream("sybil3", "collective", limit=8, peer_limit=2, now=0.0, outsider=True, outsider_limit=4) is None
    assert gate.admit_stream("sybil2", "collective", limit=8, peer_limit=2, now=0.0, outsider=True, outsider_limit=4) is not None
