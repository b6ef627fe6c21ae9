"""The per-peer log digest and the gate's rejection lines, driven by a fake clock.

What an operator relies on: a peer's first rejection in an interval is written at once and in full,
a barrage costs a bounded number of lines whatever its rate, the counts in those lines add up to
exactly the rejections made, and memory stays bounded however many peers there are.
"""

from __future__ import annotations

import logging
import math
import random
import re

import pytest

from protolearn.protocol.gate import Gate, Rejection
from protolearn.protocol.log_digest import MAX_KINDS, OTHER_KIND, LogDigest, Summary


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(digest: LogDigest[str], events: list[tuple[float, str, str]], clock: FakeClock, *, tick_s: float) -> tuple[list[tuple[float, str]], list[Summary[str]]]:
    """Feed (time, peer, kind) events in order, flushing every ``tick_s`` as the host's timer does.

    Returns the events written in full (time, peer) and the summaries, after a final flush.
    """
    written: list[tuple[float, str]] = []
    summaries: list[Summary[str]] = []
    next_tick = tick_s
    for t, peer, kind in events:
        while next_tick <= t:
            clock.now = next_tick
            summaries += digest.flush(clock())
            next_tick += tick_s
        clock.now = t
        write, due = digest.note(peer, kind, f"{kind} at {t:.3f}", clock())
        summaries += due
        if write:
            written.append((t, peer))
    summaries += digest.flush(clock(), everything=True)
    return written, summaries


def test_first_rejection_is_written_the_rest_counted_and_summarised_at_the_interval_end() -> None:
    clock = FakeClock()
    digest: LogDigest[str] = LogDigest(interval_s=10.0)
    assert digest.note("p", "TooLarge", "first", clock()) == (True, [])
    for i, kind in enumerate(["ProtocolError", "ProtocolError", "TooLarge"]):
        clock.now = 1.0 + i
        assert digest.note("p", kind, f"reason {i}", clock()) == (False, [])
    assert digest.note("q", "TooLarge", "another peer", clock()) == (True, [])  # each peer has its own interval
    clock.now = 9.99
    assert digest.flush(clock()) == [] and digest.next_due() == 10.0
    clock.now = 10.0
    (summary,) = digest.flush(clock())
    assert summary == Summary("p", 3, (("ProtocolError", 2), ("TooLarge", 1)), "reason 2", "p", 3.0)
    # q's interval (from t=3) ends without a summary: it was rejected only once, and that was written
    clock.now = 13.0
    assert digest.flush(clock()) == [] and len(digest) == 0 and digest.next_due() is None
    # after its interval, a peer's next rejection is written in full again
    assert digest.note("p", "TooLarge", "again", clock())[0] is True


def test_a_barrage_from_one_peer_costs_two_lines_per_interval_and_the_counts_add_up() -> None:
    rng = random.Random(13)
    clock = FakeClock()
    interval = 10.0
    digest: LogDigest[str] = LogDigest(interval_s=interval)
    # 40 s at about 80 rejections/s from one peer (the barrage), plus an honest peer's rare ones.
    events = [(rng.uniform(0, 40), "attacker", rng.choice(["ProtocolError", "TooLarge", "PeerTimeout"])) for _ in range(3200)]
    events += [(t, "honest", "PeerTimeout") for t in (5.0, 25.0)]
    events.sort()
    written, summaries = _run(digest, events, clock, tick_s=0.5)

    num_intervals = math.ceil(40 / interval) + 1
    assert len(written) + len(summaries) <= 2 * num_intervals + 2  # instead of 3,202 lines
    for peer in ("attacker", "honest"):
        total = sum(1 for _, p in written if p == peer) + sum(s.num_more for s in summaries if s.peer == peer)
        assert total == sum(1 for _, p, _ in events if p == peer)
    # the honest peer's two rejections, 20 s apart, are both written in full at once
    assert [t for t, p in written if p == "honest"] == [5.0, 25.0]
    # every summary counts by kind, within its interval, and the last one ends with the barrage's last rejection
    assert all(sum(n for _, n in s.kinds) == s.num_more and s.span_s <= interval for s in summaries)
    t_last, _, kind_last = [e for e in events if e[1] == "attacker"][-1]
    assert [s for s in summaries if s.peer == "attacker"][-1].last == f"{kind_last} at {t_last:.3f}"


def test_memory_and_lines_stay_bounded_when_every_rejection_comes_from_a_new_peer() -> None:
    rng = random.Random(5)
    clock = FakeClock()
    digest: LogDigest[str] = LogDigest(interval_s=10.0, max_peers=64)
    most_tracked = 0
    written = summaries = 0
    events = 0
    for second in range(30):
        for _ in range(1000):  # 1,000 fresh peer ids a second (a Sybil barrage)
            clock.now = second + rng.random() * 0.999
            write, due = digest.note(f"peer{events}", rng.choice(["TooLarge", "ProtocolError"]), "x", clock())
            events += 1
            written += write
            summaries += sum(s.num_more for s in due)
            most_tracked = max(most_tracked, len(digest))
    final = digest.flush(clock(), everything=True)
    summaries += sum(s.num_more for s in final)
    assert most_tracked <= 64
    assert written + summaries == events  # nothing is lost, it is only not written line by line
    assert written <= (64 + 1) * (math.ceil(30 / 10) + 1)  # first lines: tracked peers plus the overflow entry
    assert any(s.peer is None and s.last_peer.startswith("peer") for s in final)  # the overflow summary names its last peer


def test_kinds_beyond_the_limit_are_counted_as_other() -> None:
    digest: LogDigest[str] = LogDigest(interval_s=1.0)
    digest.note("p", "k", "first", 0.0)
    for i in range(MAX_KINDS + 5):
        digest.note("p", f"kind{i}", "x", 0.5)
    (summary,) = digest.flush(1.0)
    kinds = dict(summary.kinds)
    assert len(kinds) == MAX_KINDS + 1 and kinds[OTHER_KIND] == 5 and summary.num_more == MAX_KINDS + 5


def test_a_bad_interval_or_peer_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        LogDigest(interval_s=0.0)
    with pytest.raises(ValueError, match="must be positive"):
        LogDigest(max_peers=0)


def test_the_gate_writes_one_full_line_then_a_summary_with_the_count_and_last_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="protolearn.protocol")
    clock = FakeClock()
    gate = Gate(log_interval_s=10.0)
    for i in range(500):
        clock.now = i * 0.01
        gate.reject("12D3KooWBad", "ping", "TooLarge" if i % 5 else "ProtocolError", f"bad request {i}", clock())
    gate.record(Rejection("12D3KooWOther", "activation", "PeerTimeout", "no complete message within 2 s"), clock())
    assert sum(gate.rejected.values()) == 501 and len(gate.recent) == 256  # counting is unchanged
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rejected peer=12D3KooWBad protocol=ping reason=bad request 0",
        "rejected peer=12D3KooWOther protocol=activation reason=no complete message within 2 s",
    ]
    clock.now = 10.5
    assert gate.next_log_due() == 10.0
    gate.flush_log(clock())
    summary = caplog.records[-1].getMessage()
    assert summary == "rejected peer=12D3KooWBad: 499 more in 5.0 s (TooLarge 400, ProtocolError 99); the last: protocol=ping reason=bad request 499"
    gate.flush_log(clock(), everything=True)  # the other peer had one rejection, already written in full
    assert len(caplog.records) == 3
    # every line, summaries included, names the peer, a protocol and a reason, and the counts add up
    assert all(m.startswith("rejected peer=") and " protocol=" in m and " reason=" in m for m in (r.getMessage() for r in caplog.records))
    more = sum(int(n) for n in re.findall(r": (\d+) more in ", "\n".join(r.getMessage() for r in caplog.records)))
    assert more + 2 == 501
