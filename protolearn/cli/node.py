"""``protolearn node join``: run a volunteer node that trains one stage of the coordinator's run.

Flags are read here, once, into a :class:`~protolearn.node.config.NodeConfig`. Ctrl-C or SIGTERM
leaves the swarm gracefully (the coordinator gets the node's tickets back) and exits 0. A bad flag, an
unreachable coordinator (after ``--coordinator-wait`` seconds of retries, for a coordinator that is
restarting) or a run this node cannot train is one error line and exit 1. The node writes
its stage to ``<data dir>/checkpoints`` every ``--checkpoint-every`` steps and as it leaves; restarted
with the same data dir, or given ``--checkpoint FILE``, it restores a stage that lost all its replicas
(see :mod:`protolearn.node.persistence`).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from protolearn.errors import ConfigError, ProtolearnError

node_app = typer.Typer(help="Run a volunteer node.", no_args_is_help=True)


@node_app.command("join")
def _join(
    coordinator: Annotated[str, typer.Option("--coordinator", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    coordinator_wait: Annotated[float, typer.Option("--coordinator-wait", help="Seconds to keep retrying an unreachable coordinator (it may be restarting) before giving up; 0: one try.")] = 60.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Key, logs and checkpoints (default: ~/.protolearn/<name>).")] = None,
    listen: Annotated[str, typer.Option("--listen", help="Listen multiaddr; use a reachable IP for a multi-machine swarm.")] = "/ip4/127.0.0.1/tcp/0",
    threads: Annotated[int | None, typer.Option("--threads", help="Torch CPU threads (default: torch's choice).")] = None,
    name: Annotated[str, typer.Option("--name", help="Node name: its data dir and its label in swarm status.")] = "node",
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 autocast on CUDA (ignored on CPU).")] = False,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after this many steps (default: the run's).")] = None,
    max_in_flight: Annotated[int, typer.Option("--max-in-flight", help="Microbatches holding activations at once.")] = 8,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="A stage checkpoint to restore a stage that lost all its replicas.")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Write the stage to <data-dir>/checkpoints every N steps (0: only at leave).")] = 10,
    relay: Annotated[bool, typer.Option("--relay", help="Relay traffic for nodes behind NATs, if the coordinator finds this node reachable from the internet.")] = False,
    relay_via: Annotated[list[str] | None, typer.Option("--relay-via", metavar="MULTIADDR", help="A relay's multiaddr (ending in /p2p/<peer id>) to reserve a slot on first if this node is behind a NAT; repeatable.")] = None,
    adversary: Annotated[str | None, typer.Option("--adversary", help="Testing only: KIND[:from_step] makes this node attack the swarm (needs PROTOLEARN_ALLOW_ADVERSARY=1).", hidden=True)] = None,
) -> None:
    """Join the swarm at COORDINATOR and train the stage it assigns until the run ends."""
    import trio
    from pydantic import ValidationError

    from protolearn.node.config import NodeConfig
    from protolearn.node.lifecycle import run_node
    from protolearn.node.progress import Progress
    from protolearn.protocol.identity import default_data_dir, load_or_create_identity

    try:
        config = NodeConfig(
            coordinator=coordinator, coordinator_wait_s=coordinator_wait, device=device,
            data_dir=data_dir or default_data_dir(name), listen=listen, threads=threads, name=name, bf16=bf16, max_steps=max_steps, max_in_flight=max_in_flight,
            checkpoint=checkpoint, checkpoint_every=checkpoint_every, adversary=adversary, relay=relay, relay_via=relay_via or [],
        )
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = str(first["loc"][0]).removesuffix("_s").replace("_", "-")  # coordinator_wait_s: --coordinator-wait; relay_via.0: --relay-via
        raise ConfigError(f"--{field}: {first['msg'].removeprefix('Value error, ')}") from None
    if config.adversary is not None:
        from protolearn.node.adversary import parse_adversary

        parse_adversary(config.adversary)  # not allowed, or malformed: one line before joining
    if config.checkpoint is not None:
        from protolearn.node.checkpoint import read_checkpoint_info

        read_checkpoint_info(config.checkpoint)  # a missing or foreign file is one line before joining
    identity = load_or_create_identity(config.data_dir)
    _configure_logging(config.data_dir / "node.log")

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            result: list[int] = []

            async def watch_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        progress.say(f"{signal.Signals(sig).name}: leaving the swarm")
                        nursery.cancel_scope.cancel()
                        return

            async def work() -> None:
                result.append(await run_node(config, identity, progress))
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_signals)
            nursery.start_soon(work)
        return result[0] if result else -1

    from protolearn.cli.runner import run_trio

    with Progress(config.log_path, name=name) as progress:
        try:
            applied = run_trio(main)
        except ProtolearnError as err:
            progress.event("error", reason=str(err))
            raise
    if applied >= 0:
        typer.echo(f"{name}: done after {applied} steps", err=True)


def _configure_logging(path: Path) -> None:
    """INFO and up to the node's log file; warnings and errors to stderr as one line each."""
    root = logging.getLogger("protolearn")
    root.setLevel(logging.INFO)
    root.propagate = False  # the handlers below are the only ones; no duplicate lines via the root logger
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(file_handler)
    # libp2p logs every connection-manager tick at INFO, and every failed dial at ERROR (a peer that left
    # is normal here): its warnings go to the file only, never to the user's terminal.
    lib = logging.getLogger("libp2p")
    lib.setLevel(logging.WARNING)
    lib.addHandler(file_handler)
    lib.propagate = False
    err = logging.StreamHandler()
    err.setLevel(logging.WARNING)
    err.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root.addHandler(err)


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
