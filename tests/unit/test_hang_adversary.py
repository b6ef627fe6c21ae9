"""``--adversary hang``: the compute thread blocks for good while the rest of the node runs on."""

from __future__ import annotations

import threading

import torch
from protolearn.node.adversary import ENV, HangingWorker, parse_adversary
from protolearn.stages.config import default_run


def test_a_hanging_worker_blocks_its_first_forward_from_its_step_on() -> None:
    run = default_run()
    worker = HangingWorker(run, 0, from_step=0, after_calls=0)
    inputs = torch.zeros(1, run.batch.seq_len, dtype=torch.long)
    done = threading.Event()

    def compute() -> None:
        worker.forward(("t", 0), inputs)
        done.set()

    thread = threading.Thread(target=compute, daemon=True)
    thread.start()
    assert worker.hung.wait(timeout=30), "the forward never reached the hang"
    assert not done.wait(timeout=0.5) and thread.is_alive()  # it stays blocked
    worker.release()  # only a test can undo it
    assert done.wait(timeout=30)
    thread.join(timeout=30)


def test_hang_is_a_kind_the_cli_accepts() -> None:
    adv = parse_adversary("hang:5", env={ENV: "1"})
    assert adv.kind == "hang" and adv.from_step == 5


def test_a_hanging_worker_first_completes_the_calls_its_watchdog_judges_by() -> None:
    """By default it hangs a kind of call only after the watchdog's min_samples of it returned, so the node's
    own watchdog bounds the hang by measured times (not the two minutes a first call may take)."""
    from protolearn.node.core.watchdog import Watchdog

    run = default_run()
    worker = HangingWorker(run, 0, from_step=0)
    inputs = torch.zeros(1, run.batch.seq_len, dtype=torch.long)
    for i in range(Watchdog.min_samples):
        worker.forward(("t", i), inputs)
    assert not worker.hung.is_set()
    thread = threading.Thread(target=worker.forward, args=(("t", 99), inputs), daemon=True)
    thread.start()
    assert worker.hung.wait(timeout=30), "the forward after min_samples never reached the hang"
    worker.release()
    thread.join(timeout=30)
    assert not thread.is_alive()
