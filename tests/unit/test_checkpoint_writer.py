"""The node's background checkpoint writer: a due checkpoint holds the node's next step back only while the state
is copied, the file holds the state as it was then, and a state the writer never got to is written at leave.

Real files and real threads; the disk is made slow by holding the write in a wrapper until the test lets it go
(a fake delay only: the real write then runs)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file

from protolearn.node import persistence as persistence_module
from protolearn.node.config import NodeConfig
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.worker import StageWorker
from protolearn.protocol.identity import Identity
from tests.support.runs import tiny_run

RUN = tiny_run()


@pytest.fixture
def node_parts(tmp_path: Path) -> Iterator[tuple[StagePersistence, StageWorker]]:
    """A node's checkpoint writer and stage worker, its event log open (the test reads its ``checkpoint`` events)."""
    coordinator = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    config = NodeConfig(coordinator=coordinator, data_dir=tmp_path, checkpoint_every=1)
    with Progress(tmp_path / "node.jsonl", name="n", live=False, plain_every_s=3600.0) as progress:
        yield StagePersistence(config, RUN, progress, trio.CapacityLimiter(1)), StageWorker(RUN, 0)


def _slow_disk(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Writes wait for ``go``; ``writing`` is set when one starts."""
    go, writing = threading.Event(), threading.Event()
    real = persistence_module.write_checkpoint

    def held(prepared, *, keep):
        writing.set()
        assert go.wait(30), "the test never let the write go"
        return real(prepared, keep=keep)

    monkeypatch.setattr(persistence_module, "write_checkpoint", held)
    return go, writing


def _written(tmp_path: Path) -> list[int]:
    """The steps of the checkpoints the node said it wrote (its ``checkpoint`` events)."""
    path = tmp_path / "node.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e["step"] for e in events if e["event"] == "checkpoint"]


def _bump(worker: StageWorker) -> None:
    with torch.no_grad():
        for p in worker.params:
            p.add_(1.0)  # what the next step's optimizer would do to the live parameters


def test_a_due_checkpoint_is_written_in_the_background_with_the_state_it_was_taken_at(node_parts, tmp_path: Path, monkeypatch) -> None:
    persistence, worker = node_parts
    go, writing = _slow_disk(monkeypatch)
    before = {n: p.detach().clone() for n, p in zip(worker.names, worker.params, strict=True)}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(persistence.writer)
            with trio.fail_after(10):  # the step goes on while the disk is slow
                await persistence.after_step(0, worker, lambda: 1, target=100)
                await trio.to_thread.run_sync(writing.wait)
            _bump(worker)
            go.set()
            path = persistence.dir / "stage-0-step-1.safetensors"
            with trio.fail_after(10):
                while _written(tmp_path) != [1]:
                    await trio.sleep(0.01)
            saved = load_file(str(path))
            for n, t in before.items():
                assert torch.equal(saved[f"param/{n}"], t)  # the state when it was taken, not the bumped one
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_state_the_writer_never_got_to_is_written_at_leave(node_parts, tmp_path: Path, monkeypatch) -> None:
    persistence, worker = node_parts
    go, writing = _slow_disk(monkeypatch)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(persistence.writer)
            await persistence.after_step(0, worker, lambda: 1, target=100)
            await trio.to_thread.run_sync(writing.wait)
            _bump(worker)
            # The writer is busy with step 1: step 2's state waits for it, and the node stops meanwhile.
            with trio.move_on_after(0.3):
                await persistence.after_step(0, worker, lambda: 2, target=100)
            go.set()
            nursery.cancel_scope.cancel()  # the write under way ends first (its thread is not abandoned)
        assert _written(tmp_path) == [1]
        await persistence.at_leave(0, worker, lambda: 2)
        assert _written(tmp_path) == [1, 2]
        saved = load_file(str(persistence.dir / "stage-0-step-2.safetensors"))
        name = worker.names[0]
        assert torch.equal(saved[f"param/{name}"], worker.params[0].detach())

    trio.run(main)
