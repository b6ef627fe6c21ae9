"""``protolearn train-local``: train the run in this process with the reference trainer.

Shows a progress bar (loss, tokens/s) on stderr, writes one JSON line per step to a log file and,
with ``--json``, prints one summary object on stdout. Config problems are ConfigErrors, which
:mod:`protolearn.cli.main` prints as one line with exit code 1.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.errors import ConfigError


def _train_local(
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the built-in demo run).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps (default: the run's steps).")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Folder of text files (default: Python's stdlib sources).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
    log: Annotated[Path | None, typer.Option("--log", help="JSON-lines log (default: runs/train-local-<name>.jsonl).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="Torch CPU threads (default: all cores).")] = None,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Validation loss every N steps (and at the end).")] = 25,
) -> None:
    """Train the run locally: all its pipeline stages chained in this process."""
    import torch  # imported here so `protolearn --help` stays fast

    from protolearn.stages.config import load_run_config
    from protolearn.stages.reference import ReferenceTrainer

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps={steps} must be at least 1")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads={threads} must be at least 1")
    if eval_every < 1:
        raise ConfigError(f"--eval-every={eval_every} must be at least 1")
    run = load_run_config(config)
    if data is not None:
        run = run.replace(**{"data.path": str(data)})
    num_steps = steps if steps is not None else run.steps
    torch.set_num_threads(threads or os.cpu_count() or 1)

    log_path = log if log is not None else Path("runs") / f"train-local-{run.name}.jsonl"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("w", encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write log file '{log_path}': {err.strerror}; pass --log to a writable path") from None

    with log_file:
        trainer = ReferenceTrainer(run)
        initial_val = trainer.evaluate()
        _log(log_file, {"event": "start", "run": run.name, "run_hash": run.run_hash(), "params": trainer.num_params(),
                        "corpus": trainer.corpus.source, "corpus_fingerprint": trainer.corpus.fingerprint,
                        "initial_val_loss": initial_val})
        t0 = time.perf_counter()
        records = _train_with_progress(trainer, num_steps, eval_every, log_file)
        seconds = time.perf_counter() - t0
        final_val = next(r["val_loss"] for r in reversed(records) if r["val_loss"] is not None)
        summary = {
            "run": run.name,
            "run_hash": run.run_hash(),
            "steps": len(records),
            "params": trainer.num_params(),
            "initial_val_loss": initial_val,
            "final_val_loss": final_val,
            "first_loss": records[0]["loss"],
            "final_loss": records[-1]["loss"],
            "tokens": sum(r["tokens"] for r in records),
            "seconds": seconds,
            "s_per_step": seconds / len(records),
            "tokens_per_s": sum(r["tokens"] for r in records) / seconds,
            "threads": torch.get_num_threads(),
            "log": str(log_path),
        }
        _log(log_file, {"event": "end", **summary})
    if json_out:
        print(json.dumps(summary))
    else:
        print(
            f"{run.name}: {summary['steps']} steps in {seconds:.1f}s ({summary['tokens_per_s']:.0f} tokens/s); "
            f"val loss {initial_val:.3f} -> {final_val:.3f}; log {log_path}"
        )


def _log(f: Any, obj: dict[str, Any]) -> None:
    f.write(json.dumps(obj) + "\n")
    f.flush()


def _train_with_progress(trainer: Any, num_steps: int, eval_every: int, log_file: Any) -> list[dict[str, Any]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]train-local"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    with progress:
        task = progress.add_task("train", total=num_steps, loss="-", val="-", tps="-")
        val = "-"

        def on_step(record: dict[str, Any]) -> None:
            nonlocal val
            _log(log_file, {"event": "step", **record})
            if record["val_loss"] is not None:
                val = f"{record['val_loss']:.3f}"
            progress.update(task, advance=1, loss=f"{record['loss']:.3f}", val=val, tps=f"{record['tokens_per_s']:.0f}")

        return trainer.train(num_steps, on_step=on_step, eval_every=eval_every)


def register(app: typer.Typer) -> None:
    app.command("train-local")(_train_local)
