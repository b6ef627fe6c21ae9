"""``protolearn swarm status`` and ``swarm export``: the swarm at a glance, and its model in one file.

``status`` dials the coordinator from a throwaway identity, asks for the status once (or every
``--interval`` seconds with ``--watch``, redrawn in place with rich), and prints it as
:mod:`protolearn.cli.status_view` draws it: the verdict, ``step N of total`` with an ETA, the loss
chart with its scale, the stages, and the nodes by name (compact at 80 columns, every column on a wide
terminal or with ``--wide``). ``--json`` prints the documented
schema (``protolearn.coordinator.core.status.STATUS_JSON_SCHEMA``); with ``--watch`` one object per line.
An unreachable coordinator is one error line and exit 1.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.errors import ConfigError, ProtolearnError
from protolearn.protocol.status_schema import Status

swarm_app = typer.Typer(help="Watch and inspect a swarm.", no_args_is_help=True)


def check_address(coordinator: str) -> None:
    """A malformed coordinator address is one clear line before any dialling (as `node join` says it)."""
    from protolearn.node.config import check_coordinator_address

    try:
        check_coordinator_address(coordinator)
    except ValueError as err:
        raise ConfigError(f"--coordinator: {err}") from None


def _status(
    coordinator: Annotated[str, typer.Option("--coordinator", metavar="MULTIADDR", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    watch: Annotated[bool, typer.Option("--watch", help="Refresh in place until Ctrl-C.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the status as JSON (stable schema).")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Every column of the nodes table (peer, last seen, integrity, reach, path, flags), also on a narrow terminal.")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS", help="Seconds between refreshes with --watch.")] = 1.0,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", help="Seconds to wait for the coordinator.")] = 10.0,
    history: Annotated[int, typer.Option("--history", metavar="STEPS", help="Closed steps of loss history to fetch (the loss chart).")] = 200,
) -> None:
    """Show the swarm's health: run, step, tokens/s, loss, stages, nodes, bans."""
    import trio
    from rich.console import Console
    from rich.live import Live

    from protolearn.cli.runner import run_trio
    from protolearn.cli.status_view import render
    from protolearn.coordinator.errors import Unreachable
    from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
    from protolearn.protocol.errors import PeerTimeout, PeerUnavailable
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    if interval <= 0 or timeout <= 0:
        raise ConfigError(f"--interval={interval} and --timeout={timeout} must be positive")
    if not 0 <= history <= 10_000:
        raise ConfigError(f"--history={history} must be within 0..10000")
    check_address(coordinator)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # libp2p logs each failed dial as an error; the one line below says it better.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    console = Console(stderr=False)
    view = partial(render, wide=True if wide else None)

    def show_json(st: Status) -> None:
        print(json.dumps(st.model_dump(mode="json"), indent=None if watch else 2), flush=True)

    async def main() -> None:
        cfg = TransportConfig(request_timeout_s=timeout, connect_timeout_s=timeout)
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"], cfg) as host:
            link = CoordinatorLink(host, coordinator, retry=RetryPolicy(retry_for_s=0.0, request_timeout_s=timeout))
            try:
                st = await link.status(history)
            except (PeerUnavailable, PeerTimeout) as err:
                raise Unreachable(
                    f"cannot reach the coordinator at {coordinator}: {err.reason}; "
                    "check the address and that `protolearn coordinator start` is running"
                ) from None
            if not watch:
                show_json(st) if json_out else console.print(view(st))
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_on_signal, nursery.cancel_scope)
                await refresh(link, st)

    async def stop_on_signal(scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                scope.cancel()
                return

    async def refresh(link: Any, st: Status) -> None:
        if json_out:
            while True:
                show_json(st)
                await trio.sleep(interval)
                st = await link.status(history)
        try:
            with Live(view(st), console=console, auto_refresh=False) as live:
                while True:
                    await trio.sleep(interval)
                    try:
                        st = await link.status(history)
                        live.update(view(st), refresh=True)
                    except ProtolearnError as err:
                        from rich.console import Group
                        from rich.text import Text

                        # The last view stays, under one line that says what is wrong.
                        live.update(Group(Text(f"coordinator unreachable: {err}; retrying", style="red"), view(st)), refresh=True)
        finally:
            if not console.is_terminal:  # the last frame ends without a newline there (the shell's prompt would join it)
                console.line()

    run_trio(main)


def _export(
    coordinator: Annotated[str, typer.Option("--coordinator", metavar="MULTIADDR", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    out: Annotated[str, typer.Option("--out", metavar="FILE", help="Model file to write; its run config goes beside it as <name>.toml.")],
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", help="Seconds for the whole export.")] = 120.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Fetch every stage's parameters from live replicas (or, once the run finished, the coordinator) and write the whole model as one file."""

    if timeout <= 0:
        raise ConfigError(f"--timeout={timeout} must be positive")
    if not out or out.endswith(".toml"):
        raise ConfigError(f"--out {out!r} must name the model file (e.g. model.safetensors); its run config goes beside it as <name>.toml")
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = fetch_model(coordinator, out, timeout)
    if json_out:
        print(json.dumps({"out": str(result.out), "config": str(result.sidecar), "run": result.run.name,
                          "run_hash": result.run.run_hash(), "step": result.step, "params": result.num_params}))
    else:
        print(f"{result.run.name}: exported step {result.step} ({result.num_params} parameters) from the live swarm to {result.out}; run config {result.sidecar}")


def fetch_model(coordinator: str, out: str | Path, timeout: float) -> Any:
    """Fetch the swarm's model into ``out`` from a throwaway identity (what ``swarm export`` and
    ``generate --coordinator`` do); its :class:`~protolearn.node.export.ExportResult`."""
    from protolearn.cli.runner import run_trio
    from protolearn.node.swarm_export import export_swarm
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    check_address(coordinator)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # a failed dial is one error line, said better

    async def main() -> Any:
        cfg = TransportConfig(request_timeout_s=timeout, connect_timeout_s=min(timeout, 10.0))
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"], cfg) as host:
            return await export_swarm(host, coordinator, out, timeout_s=timeout)

    return run_trio(main)


def register(app: typer.Typer) -> None:
    swarm_app.command("status")(_status)
    swarm_app.command("export")(_export)
    app.add_typer(swarm_app, name="swarm")
