"""``protolearn export`` and ``protolearn evaluate``: the trained model as one file, and its validation loss.

``export`` assembles a folder of stage checkpoints (``stage-<s>-step-<t>.safetensors``, as nodes save
them, also in per-run subfolders) into one safetensors file of every parameter under its whole-model
name, plus ``<name>.toml`` with the run config; ``--format hf`` writes a Hugging Face Llama folder
instead (:mod:`protolearn.node.hf_export`), from checkpoints or from a model file (``--model``). ``evaluate`` loads such a file into the reference trainer's stages and reports
the loss on the run's fixed validation batches with :meth:`ReferenceTrainer.evaluate`, the same
number ``train-local`` prints. The work lives in :mod:`protolearn.node.checkpoint`; problems are
ProtolearnErrors, which :mod:`protolearn.cli.main` prints as one line with exit code 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.errors import ConfigError


def _export(
    out: Annotated[Path, typer.Option("--out", metavar="PATH", help="Model file to write (its run config goes beside it as <name>.toml); with --format hf, a folder.")],
    checkpoints: Annotated[Path | None, typer.Option("--checkpoints", metavar="DIR", help="Folder holding one checkpoint per stage (subfolders count: <data dir>/checkpoints works).")] = None,
    model: Annotated[Path | None, typer.Option("--model", metavar="FILE", help="Convert a model file (from export or swarm export) instead, e.g. to --format hf.")] = None,
    export_format: Annotated[str, typer.Option("--format", help="protolearn (one safetensors file + its run TOML) or hf (a Hugging Face Llama folder).")] = "protolearn",
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help="Run config TOML (default: the one stored in the checkpoints).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Assemble the newest step that every stage has a checkpoint of into one model (or convert a model file)."""
    import tempfile

    from protolearn.node.export import export_model, load_transformer
    from protolearn.stages.config import load_run_config

    if export_format not in ("protolearn", "hf"):
        raise ConfigError(f"--format {export_format!r} is not one of protolearn, hf")
    if (checkpoints is None) == (model is None):
        raise ConfigError("give exactly one of --checkpoints DIR (stage checkpoints) or --model FILE (a model to convert)")
    if checkpoints is not None and not checkpoints.is_dir():
        raise ConfigError(f"--checkpoints '{checkpoints}' is not a folder; pass the folder holding the stage checkpoints")
    if model is not None and export_format == "protolearn":
        raise ConfigError(f"--model '{model}' is already a protolearn model file; convert it with --format hf")
    run = load_run_config(config) if config is not None else None
    with tempfile.TemporaryDirectory(prefix="protolearn-export-") as tmp:
        source = model
        if checkpoints is not None:
            result = export_model(checkpoints, out if export_format == "protolearn" else Path(tmp) / "model.safetensors", run)
            if result.note:
                print(f"note: {result.note}", file=sys.stderr)
            if export_format == "protolearn":
                _summary(json_out, result.out, result.sidecar, result.run, result.step, result.num_params, export_format)
                return
            source = result.out
        from protolearn.node.hf_export import write_hf

        assert source is not None
        whole, info = load_transformer(source)
        written = write_hf(dict(whole.named_parameters()), info.run(), info.step, out)
        _summary(json_out, written, written / "config.json", info.run(), info.step, sum(p.numel() for p in whole.parameters()), export_format)


def _summary(json_out: bool, out: Path, sidecar: Path, run: Any, step: int, num_params: int, export_format: str) -> None:
    if json_out:
        print(json.dumps({"out": str(out), "config": str(sidecar), "run": run.name, "format": export_format,
                          "run_hash": run.run_hash(), "step": step, "params": num_params}))
    elif export_format == "hf":
        print(f"{run.name}: exported step {step} ({num_params} parameters) as a Hugging Face Llama to {out}/ "
              f"(transformers.LlamaForCausalLM.from_pretrained('{out}'))")
    else:
        print(f"{run.name}: exported step {step} ({num_params} parameters) to {out}; run config {sidecar}")


def _evaluate(
    model: Annotated[Path, typer.Option("--model", metavar="FILE", help="Model file written by `protolearn export`.")],
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help="Run config TOML (default: the one stored in the model file).")] = None,
    data: Annotated[Path | None, typer.Option("--data", metavar="DIR", help="Folder of text files (default: the run's data).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    threads: Annotated[int | None, typer.Option("--threads", metavar="N", help="Torch CPU threads (default: torch's choice).")] = None,
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
