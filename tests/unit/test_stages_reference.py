"""The reference trainer: it learns, it is deterministic, and how the model is split does not matter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protolearn.stages.config import RunConfig
from protolearn.stages.reference import ReferenceTrainer
from tests.support.runs import tiny_run, write_corpus


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_run(folder: Path, layers: list[int], clip: float | None = None) -> RunConfig:
    return tiny_run(layers, corpus=write_corpus(folder, 12, "abcabcabc def def ghi\n", 40), batch={"microbatch_size": 4, "seq_len": 32},
                    optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "total_steps": 30, "clip_norm": clip})


def test_reference_learns_and_reports_each_step(tmp_path: Path) -> None:
    trainer = ReferenceTrainer(reference_run(tmp_path, [2, 2], clip=1.0))
    initial = trainer.evaluate()
    seen: list[int] = []
    records = trainer.train(30, on_step=lambda r: seen.append(r["step"]), eval_every=10)
    assert seen == list(range(30)) and trainer.step == 30
    assert [r["val_loss"] is not None for r in records] == [(k + 1) % 10 == 0 for k in range(30)]
    assert records[-1]["val_loss"] < 0.6 * initial
    assert all(r["tokens"] == 2 * 4 * 32 and r["tokens_per_s"] > 0 for r in records)
    assert all(len(r["grad_norms"]) == 2 for r in records)


def test_reference_is_deterministic(tmp_path: Path) -> None:
    run = reference_run(tmp_path, [1, 2], clip=0.5)
    a, b = ReferenceTrainer(run), ReferenceTrainer(run)
    la = [r["loss"] for r in a.train(5, eval_every=100)]
    lb = [r["loss"] for r in b.train(5, eval_every=100)]
    assert la == lb
    assert a.stage_hashes() == b.stage_hashes()


@pytest.mark.parametrize("layers", [[2, 2], [1, 1, 2], [1, 1, 1, 1]], ids=str)
def test_split_does_not_change_training_without_clipping(tmp_path: Path, layers: list[int]) -> None:
    # Adam is per parameter, so without clipping the split changes nothing but float rounding.
    one = [r["loss"] for r in ReferenceTrainer(reference_run(tmp_path, [4])).train(6, eval_every=100)]
    split = [r["loss"] for r in ReferenceTrainer(reference_run(tmp_path, layers)).train(6, eval_every=100)]
    assert split == pytest.approx(one, rel=1e-5)
