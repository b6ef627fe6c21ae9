"""Run as a script: one replica of a demo stage through ``STEPS`` steps of the node's own compute, in a fresh
process, and print (JSON) its peak resident growth against :func:`~protolearn.stages.footprint.stage_footprint`.

Per step it does what a replica does (node/worker.py, node/averaging.py, node/finished_rounds.py): forwards
of the step's microbatches with ``max_in_flight`` graphs held at once, their backwards (per-ticket gradients
kept until the step closes), the summed vector, a received copy and the result, the two kept results, and
the optimizer step. It runs the worst case the estimate counts: a replica that applied a step may get the
next step's first microbatches (from replicas that applied it sooner) before it forgets the step's ticket
gradients, so those are dropped only once the next step's first graphs are held. The growth is measured from before the stage is built, with the kernel's peak reset.
"""

from __future__ import annotations

import json
import sys
from collections import deque

import torch

from protolearn.node.memory import ResidentMemory
from protolearn.node.worker import StageWorker
from protolearn.stages.config import default_run
from protolearn.stages.corpus import load_corpus
from protolearn.stages.footprint import stage_footprint
from protolearn.stages.sampling import microbatch

STEPS = 3


def _step(worker: StageWorker, step: int, inputs: list, hidden: list, shape: tuple, max_in_flight: int) -> torch.Tensor:
    """One step of ``worker``'s compute, with ``max_in_flight`` graphs held at once; returns the applied result."""
    b = len(inputs)
    for start in range(0, b, max_in_flight):
        tickets = range(start, min(b, start + max_in_flight))
        if worker.last:
            for i in tickets:
                worker.forward_backward_last((step, i), hidden[i], inputs[i][1])
                worker.forget(step - 1)
            continue
        for i in tickets:
            worker.forward((step, i), inputs[i][0] if worker.first else hidden[i])
        worker.forget(step - 1)
        for i in tickets:
            worker.backward((step, i), torch.ones(shape))
    flat = worker.flat_grads(step, list(range(b)))
    received, result = flat.clone(), flat.clone() / b  # what the collective receives, and its result
    worker.apply(step, result)  # its ticket gradients stay until the next step's first microbatches are in
    del flat, received
    return result


def main(stage: int, max_in_flight: int) -> dict:
    torch.set_num_threads(1)
    run = default_run()
    corpus = load_corpus(run.data)
    b, shape = run.batch.microbatches_per_step, (run.batch.microbatch_size, run.batch.seq_len, run.model.d_model)
    inputs = [microbatch(run, corpus, 0, i) for i in range(b)]
    hidden = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(b)]
    # Warm torch's kernels and allocator on a throwaway replica of a 1-ticket step, so the growth is the stage's own.
    warm = StageWorker(run, stage)
    _step(warm, 0, inputs[:1], hidden[:1], shape, 1)
    del warm
    mem = ResidentMemory()
    mem.reset_peak()
    base = mem.now()
    worker = StageWorker(run, stage)
    kept: deque[torch.Tensor] = deque(maxlen=2)  # node/finished_rounds.py keeps the last two results
    for step in range(STEPS):
        kept.append(_step(worker, step, inputs, hidden, shape, max_in_flight))
    est = stage_footprint(run, stage)
    return {"stage": stage, "max_in_flight": max_in_flight, "growth": mem.peak() - base, "estimate": est.total(max_in_flight), "params": est.params}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
