"""``protolearn generate``: sample text from the trained model, wherever it is.

The model comes from exactly one of: ``--model FILE`` (what ``protolearn export`` or ``swarm export``
wrote, or the coordinator's ``<data dir>/final/model.safetensors``), ``--checkpoints DIR`` (stage
checkpoints, assembled as ``protolearn export`` does, into a temporary file), or ``--coordinator
ADDR`` (fetched from a live swarm as ``swarm export`` does, or from the coordinator once the run
finished). :func:`protolearn.stages.textgen.sample` continues ``--prompt`` for ``--tokens`` byte tokens at
``--temperature`` among the ``--top-k`` likeliest; ``--seed`` repeats a sample. The prompt and its
continuation go to stdout; where the model came from goes to stderr.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from protolearn.errors import ConfigError


def _generate(
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue (empty: start a document).")] = "",
    model: Annotated[Path | None, typer.Option("--model", metavar="FILE", help="A model file written by `protolearn export` or `swarm export`.")] = None,
    checkpoints: Annotated[Path | None, typer.Option("--checkpoints", metavar="DIR", help="A folder of stage checkpoints (one per stage), as for `protolearn export`.")] = None,
    coordinator: Annotated[str | None, typer.Option("--coordinator", metavar="MULTIADDR", help="Fetch the model from this swarm (or its coordinator, once the run finished).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", metavar="N", help="Most tokens (bytes) to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", metavar="T", help="Sampling temperature; 0 always takes the likeliest byte.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", metavar="K", help="Sample among the K likeliest bytes (0: all).")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampling: the same seed gives the same text.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", help="Seconds to fetch the model with --coordinator.")] = 120.0,
) -> None:
    """Sample text from the trained model: continue --prompt."""
    given = [name for name, v in (("--model", model), ("--checkpoints", checkpoints), ("--coordinator", coordinator)) if v is not None]
    if len(given) != 1:
        raise ConfigError("give the model with exactly one of --model FILE, --checkpoints DIR or --coordinator MULTIADDR"
                          + (f" (got {', '.join(given)})" if given else ""))
    if tokens < 0 or not temperature >= 0 or top_k < 0:
        raise ConfigError(f"--tokens={tokens}, --temperature={temperature} and --top-k={top_k} must not be negative")
    if checkpoints is not None and not checkpoints.is_dir():
        raise ConfigError(f"--checkpoints '{checkpoints}' is not a folder; pass the folder holding the stage checkpoints")
    with tempfile.TemporaryDirectory(prefix="protolearn-generate-") as tmp:
        path = model if model is not None else _fetch(checkpoints, coordinator, Path(tmp) / "model.safetensors", timeout)
        text = _sample(path, prompt, tokens=tokens, temperature=temperature, top_k=top_k, seed=seed)
    sys.stdout.write(prompt + text + "\n")


def _fetch(checkpoints: Path | None, coordinator: str | None, out: Path, timeout: float) -> Path:
    """The model as a file: assembled from ``checkpoints`` or fetched from the swarm at ``coordinator``."""
    if checkpoints is not None:
        from protolearn.node.export import export_model

        result = export_model(checkpoints, out)
        print(f"generate: the model after step {result.step}, assembled from {checkpoints}", file=sys.stderr)
        return result.out
    assert coordinator is not None
    from protolearn.cli.swarm import fetch_model

    result = fetch_model(coordinator, out, timeout)
    print(f"generate: the model after step {result.step}, fetched from the swarm", file=sys.stderr)
    return result.out


def _sample(path: Path, prompt: str, *, tokens: int, temperature: float, top_k: int, seed: int) -> str:
    import torch

    from protolearn.node.export import load_transformer
    from protolearn.stages.textgen import sample
    from protolearn.stages.tokenizer import decode, encode

    torch.set_num_threads(min(4, torch.get_num_threads()))
    model, info = load_transformer(path)
    run = info.run()
    ids = sample(model, encode(prompt), max_new_tokens=tokens, max_seq_len=run.model.max_seq_len,
                 temperature=temperature, top_k=top_k, seed=seed)
    return decode(ids)


def register(app: typer.Typer) -> None:
    app.command("generate")(_generate)
