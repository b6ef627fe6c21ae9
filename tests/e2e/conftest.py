"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.swarm import TINY, Swarm


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Callable[..., Swarm]]:
    """``swarm(steps=..., codec=..., layers=..., stages=...)``: a :class:`Swarm` on a :data:`TINY` run config;
    every process it started is stopped when the test ends."""
    made: list[Swarm] = []

    def make(**fmt: object) -> Swarm:
        config = tmp_path / "run.toml"
        config.write_text(TINY.format(**fmt))
        s = Swarm(tmp_path, config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
