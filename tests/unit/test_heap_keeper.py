"""The coordinator's heap keeper (coordinator/heap.py): no automatic full collection while it runs, a sweep
on its timer that frees the cyclic garbage, the collector's settings back when it stops, long pauses logged."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
from protolearn.coordinator.heap import NEVER, HeapKeeper


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_cyclic_garbage_waits_for_the_sweep_and_the_settings_come_back(caplog: pytest.LogCaptureFixture) -> None:
    before = gc.get_threshold()
    keeper = HeapKeeper(0.0, sweep_every_s=600.0, warn_s=0.0)
    keeper.install()
    try:
        assert gc.get_threshold() == (before[0], before[1], NEVER) and gc.get_freeze_count() > 0
        obj = Node()
        dead = weakref.ref(obj)
        gc.collect(1)  # it survives a young collection while alive: into the oldest generation (a member's session)
        del obj
        for _ in range(50):  # young collections run as usual and leave the oldest generation alone
            gc.collect(1)
        assert dead() is not None
        assert keeper.due_s(10.0) == 590.0
        keeper.tick(10.0)
        assert dead() is not None and keeper.sweeps == 0, "nothing is due before sweep_every_s"
        with caplog.at_level(logging.WARNING, logger="protolearn.coordinator.heap"):
            keeper.tick(600.0)
        assert dead() is None and keeper.sweeps == 1, "the sweep collects it"
        assert keeper.longest_pause_s > 0 and any("paused the coordinator" in r.message for r in caplog.records)
    finally:
        keeper.uninstall()
        gc.unfreeze()
    assert gc.get_threshold() == before and keeper._on_gc not in gc.callbacks


def test_a_batch_run_has_no_automatic_full_collection_and_gets_the_settings_back() -> None:
    from protolearn.coordinator.heap import young_collections_only

    before = gc.get_threshold()
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(seen)
    try:
        with young_collections_only():
            assert gc.get_threshold() == (before[0], before[1], NEVER) and gc.get_freeze_count() > 0
            kept = [Node() for _ in range(500 * before[0])]  # allocations that trigger full collections otherwise
            assert not full and kept
    finally:
        gc.callbacks.remove(seen)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
