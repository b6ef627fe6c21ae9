"""``protolearn train-local``: train the run in this process with the reference trainer.

Shows a progress bar (loss, tokens/s) on stderr, writes one JSON line per step to a log file and,
with ``--json``, prints one summary object on stdout. Config problems are ConfigErrors, which
:mod:`protolearn.cli.main` prints as one line with exit code 1.

``--init model.safetensors`` starts from a model written by ``protolearn export``: its parameters are
copied into the stages, the run config defaults to the one stored in the file, and training continues
at the file's step, so the LR schedule and the data order pick up where the export left off. An
export carries no optimizer state, so AdamW's moments start from zero.

Threads: ``--threads`` defaults to :func:`default_threads`: two, or one when the 1-minute load
average says the other cores are busy. Measured with the demo run on this project's 2-core machines
under other jobs' load (load 2.5-4): one thread gave 3300-3500 tokens/s every time, two gave anywhere
from 980 to 5700: torch's OpenMP threads spin-wait for each other while one of them has lost its core
(with OMP_WAIT_POLICY=PASSIVE two threads gave a steady 3100-3550). The cap of two is a guess for a
model of the demo's size, not a measurement on bigger machines; pass --threads to use more cores.
"""

from __future__ import annotations

import json
import os
import sys
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
    threads: Annotated[int | None, typer.Option("--threads", help="Torch CPU threads (default: 2, or 1 if the other cores are busy).")] = None,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Validation loss every N steps (and at the end).")] = 25,
    init: Annotated[Path | None, typer.Option("--init", help="Start from a model file written by `protolearn export`.")] = None,
    codec_in_loop: Annotated[bool, typer.Option(
        "--codec-in-loop", help="Pass every boundary tensor through the run's codec, as a swarm with one node per stage does.",
    )] = False,
    replicas: Annotated[int, typer.Option(
        "--replicas", help="A DiLoCo run ([sync] mode = \"diloco\"): train as a swarm with this many replicas per stage would.",
    )] = 2,
) -> None:
    """Train the run locally: all its pipeline stages chained in this process."""
    from protolearn.stages.config import load_run_config

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps={steps} must be at least 1")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads={threads} must be at least 1")
    if eval_every < 1:
        raise ConfigError(f"--eval-every={eval_every} must be at least 1")
    if replicas < 1:
        raise ConfigError(f"--replicas={replicas} must be at least 1")
    # A mistake in the config is told before torch loads (seconds sooner), unless the run comes from --init.
    run = load_run_config(config) if config is not None or init is None else None

    import torch  # imported here so `protolearn --help` stays fast

    from protolearn.node.export import load_model, read_model_info
    from protolearn.stages.reference import ReferenceTrainer

    info = read_model_info(init) if init is not None else None
    # An exported model carries its run; an explicit --config wins (load_model checks the shapes fit).
    if run is None:
        assert info is not None
        run = info.run()
    if data is not None:
        run = run.replace(**{"data.path": str(data)})
    start_step = info.step if info is not None else 0
    if steps is None and start_step >= run.steps:
        raise ConfigError(f"'{init}' is already at step {start_step} of the run's {run.steps}; pass --steps N to train it further")
    num_steps = steps if steps is not None else run.steps - start_step
    torch.set_num_threads(threads or default_threads(os.cpu_count() or 1, _load_average()))
    if info is not None and run.run_hash() != info.run_hash:
        print(f"note: the model was trained under run {info.run_hash[:12]}; continuing it under {run.run_hash()[:12]}", file=sys.stderr)

    log_path = log if log is not None else Path("runs") / f"train-local-{run.name}.jsonl"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("w", encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write log file '{log_path}': {err.strerror}; pass --log to a writable path") from None

    links = None
    if codec_in_loop:
        from protolearn.protocol.codecs import LinkSimulator
        from protolearn.subspace import make_subspace

        subspace = None if run.subspace_key is None else make_subspace(*run.subspace_key)
        links = LinkSimulator(run.codec_spec, subspace, run.subspace.period)
    if run.sync.diloco and (init is not None or links is not None):
        raise ConfigError("a DiLoCo run ([sync] mode = \"diloco\") trains locally without --init and --codec-in-loop; drop them")
    with log_file:
        if run.sync.diloco:
            from protolearn.stages.diloco_reference import DilocoTrainer

            trainer: Any = DilocoTrainer(run, replicas=replicas)
        else:
            trainer = ReferenceTrainer(run, boundary=links)
        if init is not None:
            load_model(init, trainer.stages)
            trainer.step = start_step
        initial_val = trainer.evaluate()
        _log(log_file, {"event": "start", "run": run.name, "run_hash": run.run_hash(), "params": trainer.num_params(),
                        "corpus": trainer.corpus.source, "corpus_fingerprint": trainer.corpus.fingerprint,
                        "init": str(init) if init is not None else None, "start_step": start_step,
                        "initial_val_loss": initial_val})
        t0 = time.perf_counter()
        records = _train_with_progress(trainer, num_steps, eval_every, log_file)
        seconds = time.perf_counter() - t0
        final_val = next(r["val_loss"] for r in reversed(records) if r["val_loss"] is not None)
        summary = {
            "run": run.name,
            "run_hash": run.run_hash(),
            "steps": len(records),
            "init": str(init) if init is not None else None,
            "start_step": start_step,
            "end_step": trainer.step,
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
            "codec": run.codec if links is not None else None,
            "sync": f"diloco:{run.sync.inner_steps}x{replicas}" if run.sync.diloco else "step",
            # Wire bytes per token across one boundary, forward and backward together (None: no codec in the loop).
            "boundary_bytes_per_token": links.bytes_per_token() if links is not None and links.tokens["fwd"] else None,
        }
        _log(log_file, {"event": "end", **summary})
    if json_out:
        print(json.dumps(summary))
    else:
        since = f" (steps {start_step}-{trainer.step - 1}, from {init})" if init is not None else ""
        print(
            f"{run.name}: {summary['steps']} steps{since} in {seconds:.1f}s ({summary['tokens_per_s']:.0f} tokens/s); "
            f"val loss {initial_val:.3f} -> {final_val:.3f}; log {log_path}"
        )


def default_threads(num_cores: int, load: float) -> int:
    """Torch threads when --threads is not given: up to 2, no more than the cores left idle by ``load``."""
    idle = int(num_cores - load + 0.5)
    return max(1, min(2, idle))


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform: assume a quiet machine
        return 0.0


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
