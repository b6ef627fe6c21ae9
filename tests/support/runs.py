"""Tiny runs: a model of a few thousand parameters that trains in seconds on one core, and a corpus to feed it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protolearn.stages.config import RunConfig


def write_corpus(folder: Path, files: int, line: str, repeat: int) -> Path:
    """``files`` text files in ``folder``, each ``file <i>`` then ``line`` ``repeat`` times; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"f{i}.txt").write_text(f"file {i}\n" + line * repeat)
    return folder


def tiny_run(layers: Sequence[int] = (1, 1), *, seed: int = 3, corpus: Path | None = None, **sections: Any) -> RunConfig:
    """A run split into stages of ``layers`` blocks (d_model 32, 4 heads, 2 microbatches of 3 × 16 tokens),
    reading ``corpus`` when given; each of ``sections`` (``model={...}``, ``optim={...}``, ``name="x"``)
    updates that section of the defaults key by key."""
    raw: dict[str, Any] = {
        "name": "tiny",
        "seed": seed,
        "model": {"d_model": 32, "n_layers": sum(layers), "n_heads": 4, "d_ff": 48, "max_seq_len": 32},
        "stages": {"num_stages": len(layers), "layers": list(layers)},
        "batch": {"microbatches_per_step": 2, "microbatch_size": 3, "seq_len": 16},
    }
    if corpus is not None:
        raw["data"] = {"path": str(corpus), "val_batches": 2}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig.model_validate(raw)
