"""The single-process reference trainer: the run's S stage modules chained in one process.

Each stage is built by :func:`~protolearn.stages.stage.build_stage` and has its own optimizer from
:mod:`~protolearn.stages.optim`, exactly as in the swarm. Per step, for each of the B microbatches:
forward through the stages, last stage ``backward(i, None, loss_scale=1/B)``, then backward through
the earlier stages, so parameter grads are the mean over microbatches. Then every stage applies
:func:`~protolearn.stages.optim.apply_step` (per-stage clipping). A swarm without compression or
faults must reproduce this loss curve (invariant I3). With a ``boundary`` hook (a codec round trip),
every activation and gradient that would cross a stage boundary goes through it, so the reference
trains what a swarm with that codec trains (one replica per stage).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus, load_corpus
from protolearn.stages.optim import apply_step, lr_at, make_optimizer
from protolearn.stages.partition import PartitionPlan
from protolearn.stages.sampling import microbatch, validation_batches
from protolearn.stages.stage import StageModule, build_stage

StepRecord = dict[str, Any]
# (boundary s between stages s and s+1, "fwd" | "bwd", tensor, the microbatch's token ids) -> the tensor
# the other side receives: a codec round trip (protocol/codecs/links.py LinkSimulator), or None for none at all.
BoundaryHook = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]


class ReferenceTrainer:
    """Trains ``run`` in this process. ``step`` is the number of optimizer steps taken so far."""

    def __init__(
        self, run: RunConfig, *, device: str | torch.device = "cpu", corpus: Corpus | None = None, boundary: BoundaryHook | None = None,
    ) -> None:
        self.run = run
        self.boundary = boundary
        self.plan = PartitionPlan.from_config(run)
        self.corpus = corpus if corpus is not None else load_corpus(run.data)
        self.stages: list[StageModule] = [build_stage(run, s, device) for s in range(self.plan.num_stages)]
        self.optimizers = [make_optimizer(m.parameters(), run.optim) for m in self.stages]
        self.step = 0
        self._val = validation_batches(run, self.corpus, run.data.val_batches)

    def num_params(self) -> int:
        return sum(p.numel() for m in self.stages for p in m.parameters())

    def stage_hashes(self) -> list[str]:
        return [m.state_hash() for m in self.stages]

    def train_step(self) -> StepRecord:
        """One optimizer step over the B microbatches of step ``self.step``."""
        run, b = self.run, self.run.batch.microbatches_per_step
        t0 = time.perf_counter()
        losses: list[float] = []
        for i in range(b):
            inputs, targets = microbatch(run, self.corpus, self.step, i)
            x = inputs
            for s, stage in enumerate(self.stages):
                x = stage(i, x, targets if stage.last else None)
                if self.boundary is not None and not stage.last:
                    x = self.boundary(s, "fwd", x, inputs)
            losses.append(float(x))
            grad = None
            for s in reversed(range(len(self.stages))):
                grad = self.stages[s].backward(i, grad, loss_scale=1.0 / b if self.stages[s].last else 1.0)
                if self.boundary is not None and grad is not None:
                    grad = self.boundary(s - 1, "bwd", grad, inputs)
        norms = [apply_step(m, o, self.step, run.optim) for m, o in zip(self.stages, self.optimizers)]
        elapsed = time.perf_counter() - t0
        tokens = run.batch.tokens_per_step
        record: StepRecord = {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            "lr": lr_at(self.step, run.optim),
            "grad_norms": norms,
            "tokens": tokens,
            "seconds": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "val_loss": None,
        }
        self.step += 1
        return record

    def train(
        self,
        steps: int | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        *,
        eval_every: int = 25,
    ) -> list[StepRecord]:
        """Take ``steps`` (default ``run.steps``) steps; val_loss every ``eval_every`` steps and at the end."""
        steps = self.run.steps if steps is None else steps
        records: list[StepRecord] = []
        for k in range(steps):
            record = self.train_step()
            if (k + 1) % eval_every == 0 or k == steps - 1:
                record["val_loss"] = self.evaluate()
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the run's fixed validation microbatches."""
        total = 0.0
        for inputs, targets in self._val:
            x = inputs
            for stage in self.stages:
                x = stage.infer(x, targets if stage.last else None)
            total += float(x)
        return total / len(self._val)
