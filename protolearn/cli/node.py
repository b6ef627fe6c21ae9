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

import signal
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from protolearn.errors import ConfigError, ProtolearnError

if TYPE_CHECKING:
    from protolearn.node.config import NodeConfig

node_app = typer.Typer(help="Run a volunteer node.", no_args_is_help=True)


@node_app.command("join")
def _join(
    coordinator: Annotated[str, typer.Option("--coordinator", metavar="MULTIADDR", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    coordinator_wait: Annotated[float, typer.Option("--coordinator-wait", metavar="SECONDS", help="Seconds to keep retrying an unreachable coordinator (it may be restarting) before giving up; 0: one try.")] = 60.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N (the N-th GPU) or mps.")] = "auto",
    data_dir: Annotated[Path | None, typer.Option("--data-dir", metavar="DIR", help="Key, logs and checkpoints (default: ~/.protolearn/<name>); one process per data dir.")] = None,
    listen: Annotated[str, typer.Option("--listen", metavar="MULTIADDR", help="Listen multiaddr; /ip4/0.0.0.0/tcp/PORT for a multi-machine swarm.")] = "/ip4/127.0.0.1/tcp/0",
    announce: Annotated[list[str] | None, typer.Option("--announce", metavar="MULTIADDR", help="An address other machines reach this node at that no interface holds (port forwarding), e.g. /ip4/203.0.113.5/tcp/7701; repeatable.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", metavar="N", help="Torch CPU threads (default: torch's choice).")] = None,
    name: Annotated[str, typer.Option("--name", help="Node name: its data dir and its label in swarm status.")] = "node",
    bf16: Annotated[bool, typer.Option("--bf16", help="Compute in bf16 autocast (CUDA or CPU); the run must admit bf16 (integrity.precisions).")] = False,
    max_steps: Annotated[int | None, typer.Option("--max-steps", metavar="N", help="Stop after this many steps (default: the run's).")] = None,
    max_memory: Annotated[str | None, typer.Option("--max-memory", metavar="SIZE", help="The most memory this node's stage may use, e.g. 8GB (default: on CUDA the free memory); the coordinator places it only where the stage fits.")] = None,
    max_in_flight: Annotated[int, typer.Option("--max-in-flight", metavar="N", help="Microbatches holding activations at once.")] = 8,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", metavar="FILE", help="A stage checkpoint to restore a stage that lost all its replicas.")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", metavar="N", help="Write the stage to <data-dir>/checkpoints/<run> every N steps (0: only at leave).")] = 10,
    relay: Annotated[bool, typer.Option("--relay", help="Relay traffic for nodes behind NATs, if the coordinator finds this node reachable from the internet.")] = False,
    relay_via: Annotated[list[str] | None, typer.Option("--relay-via", metavar="MULTIADDR", help="A relay's multiaddr (ending in /p2p/<peer id>) to reserve a slot on first if this node is behind a NAT; repeatable.")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", metavar="PORT", help="Serve this node's Prometheus metrics on this port (0: any free port).")] = None,
    link: Annotated[str | None, typer.Option("--link", metavar="SPEC", help="Emulate a home link for all of this node's traffic: RATE,DELAY[,JITTER] or up=RATE,down=RATE,DELAY[,JITTER], e.g. 50mbit,40ms.")] = None,
    adversary: Annotated[str | None, typer.Option("--adversary", help="Testing only: KIND[:from_step] makes this node attack the swarm (needs PROTOLEARN_ALLOW_ADVERSARY=1).", hidden=True)] = None,
) -> None:
    """Join the swarm at COORDINATOR and train the stage it assigns until the run ends."""
    from pydantic import ValidationError

    from protolearn.data_dir_lock import DataDirLock
    from protolearn.node.config import NodeConfig
    from protolearn.protocol.identity import default_data_dir
    from protolearn.protocol.link import parse_link

    # The jitter's seed comes from the node's name, so a rerun of the same swarm sees the same jitter.
    spec = parse_link(link, seed=zlib.crc32(name.encode())) if link is not None else None
    try:
        config = NodeConfig(
            coordinator=coordinator, coordinator_wait_s=coordinator_wait, device=device,
            data_dir=data_dir or default_data_dir(name), listen=listen, threads=threads, name=name, bf16=bf16, max_steps=max_steps, max_memory=max_memory, max_in_flight=max_in_flight,
            checkpoint=checkpoint, checkpoint_every=checkpoint_every, adversary=adversary, relay=relay, relay_via=relay_via or [],
            announce=announce or [], metrics_port=metrics_port, link=spec,
        )
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = str(first["loc"][0]).removesuffix("_s").replace("_", "-")  # coordinator_wait_s: --coordinator-wait; relay_via.0: --relay-via
        raise ConfigError(f"--{field}: {first['msg'].removeprefix('Value error, ')}") from None
    # One identity runs in one process: the lock is held until this process ends (the kernel drops it
    # even on SIGKILL), so a second node on this data dir stops here with one line.
    with DataDirLock(config.data_dir, what="--name (or --data-dir)"):
        _run(config)


def _run(config: NodeConfig) -> None:
    import trio

    from protolearn.cli.logs import configure_node_logging
    from protolearn.node.coordinator_link import coordinator_peer_id
    from protolearn.node.join import resolve_device
    from protolearn.node.lifecycle import run_node
    from protolearn.node.progress import Progress
    from protolearn.protocol.identity import load_or_create_identity
    from protolearn.protocol.interfaces import parse_announce

    if config.adversary is not None:
        from protolearn.node.adversary import parse_adversary

        parse_adversary(config.adversary)  # not allowed, or malformed: one line before joining
    if config.checkpoint is not None:
        from protolearn.node.checkpoint import read_checkpoint_info

        read_checkpoint_info(config.checkpoint)  # a missing or foreign file is one line before joining
    resolve_device(config.device)  # a GPU that is not there is one line before joining
    identity = load_or_create_identity(config.data_dir)
    if identity.peer_id == coordinator_peer_id(config.coordinator):
        raise ConfigError(
            f"this node's identity ({config.data_dir}) is the coordinator's own peer id {identity.peer_id[-8:]}: it is the "
            "coordinator's data dir (or --name coordinator); give the node its own --name or --data-dir"
        )
    for addr in config.announce:
        parse_announce(addr, identity.peer_id)  # a malformed --announce is one line before joining
    name = config.name

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            result: list[int] = []

            async def watch_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        signalled.append(sig)
                        if "joined" in progress.seen:
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

    signalled: list[int] = []
    with Progress(config.log_path, name=name) as progress:
        configure_node_logging(config.data_dir / "node.log", progress.say)
        try:
            applied = run_trio(main)
        except ProtolearnError as err:
            progress.event("error", reason=str(err))
            raise
    if signalled and "joined" not in progress.seen:
        # Stopped while it still waited for the coordinator: it never was a member, so nothing was left.
        typer.echo(f"{signal.Signals(signalled[0]).name}: stopped before this node joined the swarm", err=True)
        raise typer.Exit(130)
    if applied >= 0:
        typer.echo(f"{name}: done after {applied} steps", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
