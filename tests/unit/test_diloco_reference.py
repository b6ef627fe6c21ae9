"""The in-process DiLoCo trainer (stages/diloco_reference.py): one replica with a plain outer step is the
reference trainer, and replicas are identical right after every outer sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protolearn.stages.diloco_reference import DilocoTrainer
from protolearn.stages.reference import ReferenceTrainer
from tests.support.runs import tiny_run, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), 6, "def f(x):\n    return x * 2  # double it\n", 40)


def _flat(stages) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for m in stages for p in m.parameters()])


def test_one_replica_whose_outer_step_takes_its_parameters_is_the_reference_trainer(corpus: Path) -> None:
    sync = {"mode": "diloco", "inner_steps": 3, "outer_lr": 1.0, "outer_momentum": 0.0}
    run = tiny_run((1, 1), corpus=corpus, sync=sync, steps=7, optim={"warmup_steps": 1, "total_steps": 7})
    d = DilocoTrainer(run, replicas=1)
    ref = ReferenceTrainer(run.replace(**{"sync.mode": "step"}))
    for _ in range(7):
        a, b = d.train_step(), ref.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert d.outer_syncs == 3  # after steps 2, 5 and the run's last, 6
    # anchor - (anchor - theta) is theta up to one rounding per sync.
    torch.testing.assert_close(_flat(d.replicas[0]), _flat(ref.stages), rtol=1e-5, atol=1e-6)


def test_replicas_split_the_tickets_and_are_identical_after_each_sync(corpus: Path) -> None:
    run = tiny_run((1, 1), corpus=corpus, sync={"mode": "diloco", "inner_steps": 2}, batch={"microbatches_per_step": 4}, steps=4)
    d = DilocoTrainer(run, replicas=2)
    assert d.tickets_of(0) == [0, 2] and d.tickets_of(1) == [1, 3]
    first = d.train_step()
    assert not first["outer_sync"] and not torch.equal(_flat(d.replicas[0]), _flat(d.replicas[1]))
    second = d.train_step()
    assert second["outer_sync"] and torch.equal(_flat(d.replicas[0]), _flat(d.replicas[1]))
    assert d.evaluate(0) == d.evaluate(1)
