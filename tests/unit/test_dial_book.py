"""The dial book, sans IO with an injected ``now``: a dead peer is dialled a few times, then once per
back-off, until it connects or the coordinator's view of it changes (issue 28)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protolearn.protocol.dial_book import DialBook


def test_a_peer_is_dialled_freely_until_its_dials_fail_twice_then_once_per_doubling_backoff() -> None:
    book = DialBook(max_failures=2, first_backoff_s=2.0, max_backoff_s=8.0)
    assert book.refusal("dead", 0.0) is None
    book.failed("dead", 0.0, "connection refused")
    assert book.refusal("dead", 0.1) is None  # one failure may be a fluke
    book.failed("dead", 0.1, "connection refused")
    reason = book.refusal("dead", 0.2)
    assert reason is not None and "last 2 dials failed" in reason and "connection refused" in reason and "next try in 1.9 s" in reason
    assert book.refusal("dead", 2.0) is not None and book.num_refused == 2
    # The back-off passed: one trial, and the callers asking meanwhile are refused.
    assert book.refusal("dead", 2.1) is None
    assert book.refusal("dead", 2.2) is not None
    book.failed("dead", 2.3, "connection refused")  # the trial failed: the back-off doubles (4 s)
    assert book.refusal("dead", 6.2) is not None
    assert book.refusal("dead", 6.3) is None
    book.failed("dead", 6.3, "connection refused")
    book.failed("dead", 6.3, "connection refused")
    assert book.failures("dead") == 5
    assert book.refusal("dead", 14.2) is not None and book.refusal("dead", 14.3) is None  # capped at 8 s


def test_other_peers_are_not_held_back() -> None:
    book = DialBook(max_failures=1, first_backoff_s=5.0, max_backoff_s=5.0)
    book.failed("dead", 0.0, "refused")
    assert book.refusal("dead", 1.0) is not None
    assert book.refusal("alive", 1.0) is None


@pytest.mark.parametrize("clear", ["succeeded", "forget", "retain"])
def test_a_sign_of_life_or_a_change_of_membership_clears_the_record_at_once(clear: str) -> None:
    book = DialBook(max_failures=2, first_backoff_s=10.0, max_backoff_s=10.0)
    for peer in ("a", "b"):
        book.failed(peer, 0.0, "refused")
        book.failed(peer, 0.0, "refused")
    assert book.refusal("a", 1.0) is not None
    if clear == "retain":
        book.retain({"b"})  # the coordinator's view no longer holds a
    else:
        getattr(book, clear)("a")  # it connected, a dial succeeded, or it rejoined at a new address
    assert book.refusal("a", 1.0) is None and book.failures("a") == 0
    assert book.refusal("b", 1.0) is not None  # b's record is its own
    # After the clear, "a" again gets max_failures free dials before any back-off.
    book.failed("a", 1.0, "refused")
    assert book.refusal("a", 1.0) is None


def test_the_book_holds_at_most_max_peers_records_forgetting_the_oldest() -> None:
    book = DialBook(max_failures=1, first_backoff_s=10.0, max_backoff_s=10.0, max_peers=3)
    for i in range(5):
        book.failed(f"p{i}", float(i), "refused")
    assert len(book) == 3
    assert book.refusal("p0", 5.0) is None and book.refusal("p1", 5.0) is None
    assert book.refusal("p4", 5.0) is not None


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="max_failures=0"):
        DialBook(max_failures=0)
    with pytest.raises(ValueError, match="first_backoff_s=5"):
        DialBook(first_backoff_s=5.0, max_backoff_s=1.0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(min_value=0.0, max_value=0.5), min_size=1, max_size=400),  # gaps between callers' attempts (s)
    st.integers(min_value=1, max_value=3),
    st.floats(min_value=0.5, max_value=4.0),
)
def test_a_dead_peer_costs_max_failures_dials_plus_one_per_backoff_however_often_callers_ask(
    gaps: list[float], max_failures: int, first_backoff_s: float,
) -> None:
    """Callers ask as often as they like; every allowed dial fails (the peer is dead). The number of
    dials in the window is at most max_failures + one per back-off that fits in it, the back-offs
    doubling from first_backoff_s (counted here as if they never did: a looser bound)."""
    book = DialBook(max_failures=max_failures, first_backoff_s=first_backoff_s, max_backoff_s=4 * first_backoff_s)
    now, dials = 0.0, 0
    for gap in gaps:
        now += gap
        if book.refusal("dead", now) is None:
            dials += 1
            book.failed("dead", now, "refused")
    assert dials <= max_failures + int(now // first_backoff_s) + 1
    assert dials + book.num_refused == len(gaps)
