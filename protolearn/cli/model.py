"""``protolearn export`` and ``protolearn evaluate``: the trained model as one file, and its validation loss.

``export`` assembles a folder of stage checkpoints (``stage-<s>-step-<t>.safetensors``, as nodes save
them) into one safetensors file of every parameter under its whole-model name, plus ``<name>.toml``
with the run config. ``evaluate`` loads such a file into the reference trainer's stages and reports
the loss on the run's fixed validation batches with :meth:`ReferenceTrainer.evaluate`, the same
number ``train-local`` prints. The work lives in :mod:`protolearn.node.checkpoint`; problems are
ProtolearnErrors, which :mod:`protolearn.cli.main` prints as one line with exit code 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from protolearn.errors import ConfigError


def _export(
    checkpoints: Annotated[Path, typer.Option("--checkpoints", help="Folder holding one checkpoint per stage.")],
    out: Annotated[Path, typer.Option("--out", help="Model file to write; its run config goes beside it as <name>.toml.")],
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the one stored in the checkpoints).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Assemble the newest step that every stage has a checkpoint of into one model file."""
    from protolearn.node.export import export_model
    from protolearn.stages.config import load_run_config

    if not checkpoints.is_dir():
        raise ConfigError(f"--checkpoints '{checkpoints}' is not a folder; pass the folder holding the stage checkpoints")
    run = load_run_config(config) if config is not None else None
    result = export_model(checkpoints, out, run)
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    if json_out:
        print(json.dumps({"out": str(result.out), "config": str(result.sidecar), "run": result.run.name,
                          "run_hash": result.run.run_hash(), "step": result.step, "params": result.num_params}))
    else:
        print(f"{result.run.name}: exported step {result.step} ({result.num_params} parameters) to {result.out}; run config {result.sidecar}")


def _evaluate(
    model: Annotated[Path, typer.Option("--model", help="Model file written by `protolearn export`.")],
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the one stored in the model file).")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Folder of text files (default: the run's data).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    threads: Annotated[int | None, typer.Option("--threads", help="Torch CPU threads (default: torch's choice).")] = None,
) -> None:
    """Report the model's loss on the run's fixed validation batches."""
    import torch  # imported here so `protolearn --help` stays fast

    from protolearn.node.export import load_model, read_model_info
    from protolearn.stages.config import load_run_config
    from protolearn.stages.reference import ReferenceTrainer

    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads={threads} must be at least 1")
        torch.set_num_threads(threads)
    info = read_model_info(model)
    run = load_run_config(config) if config is not None else info.run()
    if data is not None:
        run = run.replace(**{"data.path": str(data)})
    if run.run_hash() != info.run_hash:
        print(f"note: the model was trained under run {info.run_hash[:12]}; evaluating it under {run.run_hash()[:12]}", file=sys.stderr)
    trainer = ReferenceTrainer(run)
    load_model(model, trainer.stages)
    val_loss = trainer.evaluate()
    summary = {"model": str(model), "run": run.name, "run_hash": run.run_hash(), "step": info.step,
               "val_loss": val_loss, "val_batches": run.data.val_batches}
    if json_out:
        print(json.dumps(summary))
    else:
        print(f"{run.name} step {info.step}: val loss {val_loss:.4f} over {run.data.val_batches} validation batches")


def register(app: typer.Typer) -> None:
    app.command("export")(_export)
    app.command("evaluate")(_evaluate)
