"""The watchdog's adapter (node/compute_watch.py) with real threads: a compute call that never returns
is reported once, and a process that was stopped (its wake-up comes late) does not count against it."""

from __future__ import annotations

import threading

import torch

import trio
from protolearn.node.compute_watch import ComputeWatch
from protolearn.node.core.watchdog import Overdue, Watchdog


class _Worker:
    def __init__(self) -> None:
        self.release = threading.Event()

    def forward(self, x: int) -> int:
        return x + 1

    def backward(self, x: int) -> int:
        self.release.wait(30)
        return x


def test_a_call_that_never_returns_is_reported_once_and_quick_ones_never() -> None:
    worker = _Worker()
    watch = ComputeWatch(Watchdog(floor_s=0.3, first_s=0.3, min_samples=1))
    for name in ("forward", "backward"):
        setattr(worker, name, watch.wrap(name, getattr(worker, name)))  # type: ignore[arg-type]
    seen: list[Overdue] = []

    async def main() -> None:
        with trio.fail_after(20):
            for i in range(20):
                assert await trio.to_thread.run_sync(worker.forward, i) == i + 1
            hung = trio.Event()

            async def on_hung(late: Overdue) -> None:
                seen.append(late)
                hung.set()

            async with trio.open_nursery() as nursery:
                await nursery.start(watch.watch, on_hung)
                nursery.start_soon(trio.to_thread.run_sync, worker.backward, 0)
                await hung.wait()
                worker.release.set()

    trio.run(main)
    assert len(seen) == 1 and seen[0].kind == "backward" and seen[0].running_s > 0.3
    assert "stage 3 compute (backward) has not returned" in seen[0].line(3)


def test_a_late_wake_up_moves_the_running_calls_on() -> None:
    # The clock jumps 60 s while a call runs, as it does for a SIGSTOPped process: no verdict.
    offset = [0.0]
    watch = ComputeWatch(Watchdog(floor_s=5.0, first_s=5.0), clock=lambda: trio.current_time() + offset[0])

    async def main() -> None:
        token_kind = "forward"
        with watch._lock:
            watch.watchdog.started(token_kind, watch.clock())
        fired: list[Overdue] = []

        async def on_hung(late: Overdue) -> None:
            fired.append(late)

        async with trio.open_nursery() as nursery:
            await nursery.start(watch.watch, on_hung)
            await trio.sleep(0.2)
            offset[0] += 60.0
            await trio.sleep(2.5)
            nursery.cancel_scope.cancel()
        assert fired == []

    trio.run(main)


def test_attach_keeps_every_worker_method_callable_as_before() -> None:
    # A spot check asks for its bf16 recomputation by keyword (node/check_serving.py): the timed method takes it.
    from protolearn.node.worker import StageWorker
    from protolearn.stages.config import RunConfig

    run = RunConfig.model_validate({"name": "watch", "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32, "max_seq_len": 8},
                                    "batch": {"microbatches_per_step": 1, "microbatch_size": 1, "seq_len": 8}})
    worker = StageWorker(run, 0)
    ComputeWatch(Watchdog()).attach(worker)
    tokens = [torch.zeros(1, 8, dtype=torch.long)]
    assert torch.equal(worker.recompute(0, "fwd", tokens, None, bf16=False), worker.recompute(0, "fwd", tokens, None))
