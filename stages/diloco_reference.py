"""DiLoCo in one process: R replicas of the whole model trained as a DiLoCo swarm with R replicas per stage would.

The single-process counterpart of ``[sync] mode = "diloco"`` (what :class:`~protolearn.stages.reference.ReferenceTrainer`
is to per-step averaging), for comparing the two modes' loss curves on the same data without a swarm
(``protolearn train-local`` on a DiLoCo run; ``bench.py sync``). Step t's B tickets are split between
the replicas (ticket i goes to replica ``i mod R``, an even split as a balanced swarm's is); each replica
takes its own AdamW inner step on the mean gradient of its tickets, with the run's learning-rate schedule
and per-stage clipping; after every ``inner_steps`` steps, and after the run's last step, each stage's
replicas average their pseudo-gradients weighted by their tickets and apply the Nesterov outer step of
:mod:`~protolearn.stages.outer`, so they hold identical parameters again. The inner AdamW state stays each
replica's, as in the swarm. What a swarm adds that this leaves out: which replica takes which ticket varies
with the balancer, and a replica may be left out of a round.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus, load_corpus
from protolearn.stages.optim import apply_step, lr_at, make_optimizer
from protolearn.stages.outer import flatten, nesterov_step, unflatten_into
from protolearn.stages.partition import PartitionPlan
from protolearn.stages.sampling import microbatch, validation_batches
from protolearn.stages.stage import StageModule, build_stage

StepRecord = dict[str, Any]


class DilocoTrainer:
    """Trains ``run`` (a DiLoCo run: ``run.sync``) with ``replicas`` replicas in this process."""

    def __init__(self, run: RunConfig, *, replicas: int = 2, device: str | torch.device = "cpu", corpus: Corpus | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas={replicas} must be at least 1")
        self.run = run
        self.num_replicas = replicas
        self.plan = PartitionPlan.from_config(run)
        self.corpus = corpus if corpus is not None else load_corpus(run.data)
        # Every replica starts from the same deterministic init, as every replica of a swarm does.
        self.replicas: list[list[StageModule]] = [[build_stage(run, s, device) for s in range(self.plan.num_stages)] for _ in range(replicas)]
        self.optimizers = [[make_optimizer(m.parameters(), run.optim) for m in stages] for stages in self.replicas]
        self.anchors = [flatten(self._params(0, s)) for s in range(self.plan.num_stages)]  # per stage, (N_s,)
        self.momenta = [torch.zeros_like(a) for a in self.anchors]
        self.step = 0
        self.outer_syncs = 0
        self._val = validation_batches(run, self.corpus, run.data.val_batches)

    def num_params(self) -> int:
        """Parameters of one replica (the model's)."""
        return sum(p.numel() for m in self.replicas[0] for p in m.parameters())

    def _params(self, replica: int, stage: int) -> list[torch.nn.Parameter]:
        module = self.replicas[replica][stage]
        params = dict(module.named_parameters())
        return [params[n] for n in module.param_names()]

    def tickets_of(self, replica: int) -> list[int]:
        return [i for i in range(self.run.batch.microbatches_per_step) if i % self.num_replicas == replica]

    def train_step(self) -> StepRecord:
        """Inner step ``self.step`` on every replica, then the outer sync if the step ends an outer round."""
        run, t0 = self.run, time.perf_counter()
        losses: list[float] = []
        norms = []
        for r, stages in enumerate(self.replicas):
            mine = self.tickets_of(r)
            for i in mine:
                inputs, targets = microbatch(run, self.corpus, self.step, i)
                x = inputs
                for stage in stages:
                    x = stage(i, x, targets if stage.last else None)
                losses.append(float(x))
                grad = None
                for s in reversed(range(len(stages))):
                    grad = stages[s].backward(i, grad, loss_scale=1.0 / len(mine) if stages[s].last else 1.0)
            if mine:
                norms.append([apply_step(m, o, self.step, run.optim) for m, o in zip(stages, self.optimizers[r])])
        synced = (self.step + 1) % run.sync.inner_steps == 0 or self.step == run.steps - 1
        if synced:
            self.outer_sync()
        elapsed = time.perf_counter() - t0
        record: StepRecord = {
            "step": self.step, "loss": sum(losses) / len(losses), "lr": lr_at(self.step, run.optim), "grad_norms": norms,
            "tokens": run.batch.tokens_per_step, "seconds": elapsed, "tokens_per_s": run.batch.tokens_per_step / elapsed if elapsed > 0 else 0.0,
            "outer_sync": synced, "val_loss": None,
        }
        self.step += 1
        return record

    @torch.no_grad()
    def outer_sync(self) -> None:
        """Each stage: the ticket-weighted mean pseudo-gradient of its replicas, then the Nesterov outer step."""
        sync = self.run.sync
        weights = [float(len(self.tickets_of(r))) for r in range(self.num_replicas)]
        total = sum(weights)
        for s in range(self.plan.num_stages):
            avg = torch.zeros_like(self.anchors[s])
            for r, w in enumerate(weights):
                if w:
                    avg += (self.anchors[s] - flatten(self._params(r, s))) * w
            avg /= total
            self.anchors[s], self.momenta[s] = nesterov_step(self.anchors[s], self.momenta[s], avg, lr=sync.outer_lr, mu=sync.outer_momentum)
            for r in range(self.num_replicas):
                unflatten_into(self.anchors[s], self._params(r, s))
        self.outer_syncs += 1

    def train(self, steps: int | None = None, on_step: Any = None, *, eval_every: int = 25) -> list[StepRecord]:
        """Take ``steps`` (default ``run.steps``) steps; val_loss (of replica 0) every ``eval_every`` steps and at the end."""
        steps = self.run.steps if steps is None else steps
        records = []
        for k in range(steps):
            record = self.train_step()
            if (k + 1) % eval_every == 0 or k == steps - 1:
                record["val_loss"] = self.evaluate()
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    @torch.no_grad()
    def evaluate(self, replica: int = 0) -> float:
        """Mean loss of ``replica`` over the run's fixed validation microbatches (after a sync: the stage's shared state)."""
        total = 0.0
        for inputs, targets in self._val:
            x = inputs
            for stage in self.replicas[replica]:
                x = stage.infer(x, targets if stage.last else None)
            total += float(x)
        return total / len(self._val)
