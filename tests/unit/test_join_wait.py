"""A starting node's wait for its coordinator, on trio's mock clock with a fake host.

What a volunteer relies on: a coordinator that is restarting is waited for (with capped backoff and
a line per retry), a dead one costs at most ``--coordinator-wait`` seconds and then the usual error
line, and an address that answers with another peer ID fails at once.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import trio
import trio.testing
from pydantic import ValidationError

from protolearn.node import join
from protolearn.node.config import NodeConfig
from protolearn.node.errors import JoinError
from protolearn.protocol.errors import PeerUnavailable, WrongPeer

ADDR = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"


class FakeHost:
    """``connect`` fails (after ``dial_s``) until ``up_at``, then succeeds; or always raises ``wrong``."""

    def __init__(self, *, up_at: float = float("inf"), dial_s: float = 0.7, wrong: bool = False) -> None:
        self.up_at, self.dial_s, self.wrong = up_at, dial_s, wrong
        self.dials: list[tuple[float, float]] = []  # (when, timeout)

    async def connect(self, addr: str, *, timeout: float | None = None) -> str:
        assert timeout is not None
        self.dials.append((trio.current_time(), timeout))
        if self.wrong:
            raise WrongPeer("x", "/ip4/127.0.0.1/tcp/9 answered with another peer id than x")
        if trio.current_time() >= self.up_at:
            return "x"
        await trio.sleep(min(self.dial_s, timeout))
        raise PeerUnavailable("x", "could not connect: connection refused")


def _wait(host: FakeHost, wait_s: float, lines: list[str]) -> float:
    """Run wait_for_coordinator on a mock clock; returns the (virtual) seconds it took."""
    random.seed(3)
    config = NodeConfig(coordinator=ADDR, data_dir=Path("/nonexistent"), coordinator_wait_s=wait_s)

    async def main() -> float:
        start = trio.current_time()
        await join.wait_for_coordinator(host, config, on_wait=lines.append)  # type: ignore[arg-type]
        return trio.current_time() - start

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_restarting_coordinator_is_waited_for_with_a_line_per_retry() -> None:
    host, lines = FakeHost(up_at=3.0), []
    took = _wait(host, 60.0, lines)
    assert 3.0 <= took < 3.0 + join.MAX_RETRY_S  # found within one (capped) backoff of coming back
    assert len(lines) == len(host.dials) - 1 >= 2
    for n, line in enumerate(lines, start=1):
        assert line.startswith(f"waiting for the coordinator at {ADDR} (attempt {n}, retry in ") and line.endswith(" s)")


def test_a_dead_coordinator_costs_the_wait_with_capped_backoff_then_the_usual_error() -> None:
    host, lines = FakeHost(), []
    with pytest.raises(JoinError) as info:
        _wait(host, 30.0, lines)
    text = str(info.value)
    assert text.startswith(f"cannot reach the coordinator at {ADDR} (waited 30 s, {len(host.dials)} attempts): ")
    assert "connection refused" in text and "coordinator is running" in text and "\n" not in text
    starts = [t for t, _ in host.dials]
    assert starts[-1] <= 30.0 + 1e-9 and starts[-1] + host.dials[-1][1] <= 30.0 + join.MIN_DIAL_S + 1e-9  # bounded
    gaps = [b - a - host.dial_s for a, b in zip(starts, starts[1:], strict=False)]
    assert max(gaps) <= join.MAX_RETRY_S + 1e-9 and gaps[0] <= join.FIRST_RETRY_S  # backoff grows but is capped
    assert len(host.dials) <= 30.0 / (join.MAX_RETRY_S / 2) + 6  # a dead coordinator costs one dial every few s


def test_no_wait_is_one_dial_with_the_full_deadline() -> None:
    host, lines = FakeHost(), []
    with pytest.raises(JoinError, match="^cannot reach the coordinator at /ip4/127.0.0.1/tcp/9/p2p/[^ ]+: could not connect"):
        _wait(host, 0.0, lines)
    assert len(host.dials) == 1 and host.dials[0][1] == join.DIAL_TIMEOUT_S and lines == []


def test_an_address_that_answers_with_another_peer_id_fails_at_once() -> None:
    host, lines = FakeHost(wrong=True), []
    with pytest.raises(JoinError, match="answered with another peer id"):
        _wait(host, 60.0, lines)
    assert len(host.dials) == 1 and lines == []


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("coordinator", "/ip4/127.0.0.1/tcp/9/p2p/garbage", "is not a valid multiaddr (Invalid CID: garbage)"),
        ("coordinator_wait_s", -1.0, "greater than or equal to 0"),
    ],
)
def test_a_bad_coordinator_address_or_wait_is_refused_before_any_dial(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(expected)):
        NodeConfig(**{"coordinator": ADDR, "data_dir": Path("/nonexistent"), field: value})
