"""The count behind the per-address connection cap (protocol/transport/inbound.py), without sockets."""

from __future__ import annotations

from protolearn.protocol.transport.inbound import InboundCap


def test_one_address_holds_at_most_its_share_pending_and_established_together_and_others_are_not_affected() -> None:
    cap = InboundCap(max_per_ip=3, max_pending=100)
    assert cap.begin("203.0.113.5") is None
    cap.opened(1, "203.0.113.5")
    cap.end("203.0.113.5")
    assert cap.begin("203.0.113.5") is None and cap.begin("203.0.113.5") is None  # two handshakes in flight
    why = cap.begin("203.0.113.5")
    assert why is not None and "203.0.113.5 holds 3 connections" in why and cap.refused["per_ip"] == 1
    assert cap.begin("198.51.100.7") is None  # another address has its own share
    cap.end("203.0.113.5")  # a handshake failed: its slot comes back
    assert cap.begin("203.0.113.5") is None
    cap.closed(1)
    cap.closed(1)  # a second close of the same connection releases nothing more
    assert cap.held("203.0.113.5") == 2 and cap.num_established == 0


def test_handshakes_in_flight_are_capped_over_all_addresses() -> None:
    cap = InboundCap(max_per_ip=10, max_pending=2)
    assert cap.begin("192.0.2.1") is None and cap.begin("192.0.2.2") is None
    assert cap.begin("192.0.2.3") is not None and cap.refused["handshakes"] == 1
    cap.end("192.0.2.1")
    assert cap.begin("192.0.2.3") is None


def test_loopback_is_this_machine_and_exempt_unless_capped_on_purpose() -> None:
    free, capped = InboundCap(max_per_ip=1, max_pending=100), InboundCap(max_per_ip=1, max_pending=100, cap_loopback=True)
    for ip in ("127.0.0.1", "::1"):
        assert free.begin(ip) is None and free.begin(ip) is None
        assert capped.begin(ip) is None and capped.begin(ip) is not None
