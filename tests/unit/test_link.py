"""The link model (protocol/link.py) on a fake clock: the grammar, the token bucket, the delay line, and
what a request/reply and a pipelined stream cost through it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.errors import ConfigError
from protolearn.protocol.link import (
    DEFAULT_BURST_BYTES,
    DelayLine,
    Link,
    LinkSpec,
    TokenBucket,
    parse_link,
    parse_links_file,
)


# -- the grammar --------------------------------------------------------------------------------


def test_symmetric_and_asymmetric_specs() -> None:
    s = parse_link("50mbit,40ms")
    assert (s.up_bits, s.down_bits, s.delay_s, s.jitter_s) == (50e6, 50e6, 0.04, 0.0)
    a = parse_link("up=20mbit,down=100mbit,30ms,5ms")
    assert (a.up_bits, a.down_bits, a.delay_s, a.jitter_s) == (20e6, 100e6, 0.03, 0.005)
    assert parse_link("down=1gbit,up=500kbit,250us").up_bits == 500e3
    assert parse_link(" 2.5Mbit , 0.1s ").down_bits == 2.5e6


@pytest.mark.parametrize("text", ["50mbit,40ms", "up=20mbit,down=100mbit,30ms,5ms", "1gbit,0ms", "700kbit,250us"])
def test_text_round_trips(text: str) -> None:
    spec = parse_link(text)
    assert parse_link(spec.text) == spec


@pytest.mark.parametrize(("text", "says"), [
    ("50mbps,40ms", "bytes per second are not accepted"),
    ("50,40ms", "must be a number with bit"),
    ("50mbit", "DELAY"),
    ("50mbit,40ms,5ms,1ms", "DELAY"),
    ("50mbit,40", "must be a number with us, ms or s"),
    ("up=20mbit,30ms", "needs both up= and down="),
    ("up=20mbit,up=30mbit,30ms", "given twice"),
    ("side=20mbit,down=2mbit,30ms", "not up= or down="),
    ("50mbit,10ms,20ms", "exceeds the delay"),
    ("50mbit,2s", "exceeds"),
    ("50mbit,,1ms", "empty field"),
    ("200gbit,1ms", "outside"),
])
def test_bad_specs_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_link(text)


def test_links_file_one_profile_per_node() -> None:
    specs = parse_links_file("# node 0 is at home\n50mbit,40ms\n\nnone  # node 1 in the data centre\nup=20mbit,down=100mbit,30ms\n", where="f")
    assert [None if s is None else s.text for s in specs] == ["50mbit,40ms", None, "up=20mbit,down=100mbit,30ms"]
    with pytest.raises(ConfigError, match="f line 2"):
        parse_links_file("50mbit,40ms\n50mbit\n", where="f")


def test_transport_refuses_a_link_slower_than_its_minimum_rate() -> None:
    from protolearn.protocol.transport.config import TransportConfig, usable_link

    assert usable_link(parse_link("5mbit,10ms")).up_bits == 5e6
    with pytest.raises(ConfigError, match="too slow for the transport"):
        usable_link(parse_link("up=1mbit,down=50mbit,10ms"))
    assert TransportConfig().link is None


# -- the token bucket ---------------------------------------------------------------------------


def test_bucket_lets_a_burst_go_then_paces_at_the_rate() -> None:
    b = TokenBucket(rate=1000.0, burst=100.0)
    assert b.reserve(100, now=0.0) == 0.0  # a full bucket: at once
    assert b.reserve(50, now=0.0) == pytest.approx(0.05)  # empty: 50 bytes at 1000 B/s
    assert b.reserve(10, now=0.0) == pytest.approx(0.06)  # FIFO behind the previous batch
    assert b.reserve(10, now=10.0) == 10.0  # refilled while idle (up to the burst)
    assert b.reserve(200, now=10.0) == pytest.approx(10.0 + (200 - 90) / 1000)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200_000), st.floats(0, 0.05)), min_size=1, max_size=60), st.floats(1e4, 1e8))
def test_bucket_never_beats_its_rate(batches: list[tuple[int, float]], rate: float) -> None:
    """Whatever the arrival pattern, bytes leave no faster than burst + rate × time, in FIFO order."""
    b = TokenBucket(rate=rate, burst=DEFAULT_BURST_BYTES)
    now, first, total, last = 0.0, None, 0, float("-inf")
    for n, gap in batches:
        now += gap
        leave = b.reserve(n, now)
        first = now if first is None else first
        total += n
        assert leave >= now and leave >= last
        last = leave
        assert total <= DEFAULT_BURST_BYTES + rate * (leave - first) * (1 + 1e-9) + 1e-6


# -- the delay line -----------------------------------------------------------------------------


def test_delay_line_is_seeded_and_never_reorders() -> None:
    a, b = DelayLine(0.03, 0.01, seed=7), DelayLine(0.03, 0.01, seed=7)
    leaves = [i * 0.001 for i in range(500)]
    out_a = [a.arrive(t) for t in leaves]
    assert out_a == [b.arrive(t) for t in leaves]
    assert out_a == sorted(out_a)
    assert all(t + 0.02 - 1e-12 <= got for t, got in zip(leaves, out_a, strict=True))
    # Spread-out batches see DELAY ± JITTER, centred on DELAY.
    c = DelayLine(0.03, 0.01, seed=1)
    delays = [c.arrive(i * 1.0) - i * 1.0 for i in range(2000)]
    assert 0.02 <= min(delays) and max(delays) <= 0.04
    assert sum(delays) / len(delays) == pytest.approx(0.03, abs=0.001)


# -- what messages cost -------------------------------------------------------------------------


def test_a_round_trip_to_an_unshaped_peer_costs_twice_the_delay_plus_serialisation() -> None:
    spec = parse_link("8mbit,40ms")  # 1 MB/s
    link = Link(spec.model_copy(update={"burst_bytes": 1}))
    request, reply = 100_000, 50_000
    sent = link.up.send(request, now=5.0)
    assert sent.leave == pytest.approx(5.0 + request / 1e6, abs=1e-5)  # less the one-byte burst
    assert sent.arrive == pytest.approx(sent.leave + 0.04)
    # The unshaped peer answers at once; the reply's bytes reach our socket when it sent them.
    got = link.down.send(reply, now=sent.arrive)
    assert got.arrive - 5.0 == pytest.approx(2 * 0.04 + (request + reply) / 1e6, abs=1e-5)


def test_a_pipelined_stream_pays_the_delay_once() -> None:
    link = Link(parse_link("8mbit,40ms"))
    frame = 64 * 1024
    for _ in range(100):  # the writer hands over frame after frame at once (its send queue holds them)
        p = link.up.send(frame, now=0.0)
    total = 100 * frame
    assert p.arrive == pytest.approx((total - DEFAULT_BURST_BYTES) / 1e6 + 0.04, rel=1e-6)
    assert link.up.stats.bytes == total and link.up.stats.batches == 100
    assert link.up.stats.serialisation_s == pytest.approx(total / 1e6)
    assert link.down.stats.bytes == 0


def test_two_shaped_nodes_add_their_delays() -> None:
    a, b = Link(parse_link("100mbit,30ms")), Link(parse_link("100mbit,10ms", seed=3))
    out = b.down.send(200, now=a.up.send(200, now=0.0).arrive)  # a -> b
    back = a.down.send(200, now=b.up.send(200, now=out.arrive).arrive)  # b -> a
    assert back.arrive == pytest.approx(2 * (0.03 + 0.01), abs=1e-4)


def test_spec_validates_its_fields() -> None:
    with pytest.raises(ValueError):
        LinkSpec(up_bits=0, down_bits=1e6, delay_s=0.01)
    with pytest.raises(ValueError):
        LinkSpec(up_bits=1e6, down_bits=1e6, delay_s=-1)
