"""Shared fixtures for integration tests: real libp2p hosts on 127.0.0.1 inside one trio run.

Tests are plain functions that call ``run_trio(main)``; ``main`` is an async function run under a
deadline (``trio.fail_after``), so a hang fails the test instead of stalling CI. Inside ``main``,
``async with open_hosts(2) as (a, b):`` gives started hosts, each with a fresh identity, already able
to dial each other by peer ID (their addresses are exchanged); leaving the block closes them all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import TransportConfig

from tests.support.hosts import open_mesh

# Short deadlines so failure paths finish fast; generous enough for a busy 2-core CI box.
FAST_CONFIG = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=5.0)


def _open_hosts(n: int, config: TransportConfig | None = None, *, introduce: bool = True) -> Any:
    return open_mesh([Identity.generate() for _ in range(n)], FAST_CONFIG if config is None else config, introduce=introduce)


@pytest.fixture
def open_hosts() -> Callable[..., Any]:
    """``async with open_hosts(n, config=None, introduce=True) as hosts:`` n started real hosts."""
    return _open_hosts


@pytest.fixture
def run_trio() -> Callable[..., Any]:
    """``run_trio(main, timeout=30)`` runs ``await main()`` in a fresh trio run under a deadline."""

    def run(main: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
        async def guarded() -> Any:
            with trio.fail_after(timeout):
                return await main()

        return trio.run(guarded)

    return run


@pytest.fixture
def fast_config() -> TransportConfig:
    return FAST_CONFIG
