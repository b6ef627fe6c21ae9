"""``protolearn swarm status``: the swarm at a glance, as a table, a live view or stable JSON.

It dials the coordinator from a throwaway identity, asks for the status once (or every
``--interval`` seconds with ``--watch``, redrawn in place with rich), and prints: the run, the step,
tokens/s, the loss with a sparkline, each stage's replicas and throughput (an empty stage is shown as
halting training), each node, the bans, and a one-line verdict. ``--json`` prints the documented
schema (``protolearn.coordinator.core.status.STATUS_JSON_SCHEMA``); with ``--watch`` one object per line.
An unreachable coordinator is one error line and exit 1.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Annotated, Any

import typer

from protolearn.errors import ConfigError, ProtolearnError
from protolearn.protocol.status_schema import Status

swarm_app = typer.Typer(help="Watch and inspect a swarm.", no_args_is_help=True)

SPARKS = "▁▂▃▄▅▆▇█"
VERDICT_STYLE = {"healthy": "bold green", "degraded": "bold yellow", "halted": "bold white on red"}


def sparkline(values: list[float], width: int = 40) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(SPARKS[0 if span <= 0 else min(len(SPARKS) - 1, int((v - lo) / span * (len(SPARKS) - 1) + 0.5))] for v in vals)


def short(peer_id: str) -> str:
    return f"…{peer_id[-8:]}" if len(peer_id) > 10 else peer_id


def _integrity(n: Any) -> str:
    """A node's monitor score and probation state, as its checkers report them ("-" when none checks it)."""
    if n.integrity is None:
        return "-"
    return f"{n.integrity:.2f} {n.probation}".strip()


def render(st: Status) -> Any:
    """A rich renderable of the status (what the terminal shows)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text()
    head.append(f"run {st.run.name}", style="bold")
    head.append(f" (hash {st.run.run_hash[:12]}) · {st.run.num_stages} stages · B={st.run.microbatches_per_step}")
    head.append(f" · coordinator {short(st.coordinator)} · up {st.uptime_s:.0f}s")
    verdict = Text(f"{st.verdict.upper()}", style=VERDICT_STYLE[st.verdict])
    verdict.append(f"  {st.verdict_reason}", style="")
    loss = "-" if st.loss is None else f"{st.loss:.4f}"
    closed = f"last closed {st.last_closed}"
    if st.last_committed < st.last_closed:
        closed += ", its stages still averaging it"
    progress = Text(f"step {st.step} ({closed}) · {st.tokens_per_s:,.0f} tokens/s · loss {loss}  ")
    progress.append(sparkline([p.loss for p in st.loss_history]), style="cyan")

    stages = Table(title="stages", title_justify="left", expand=False)
    for col in ("stage", "layers", "replicas", "throughput", "params@step", "hashes"):
        stages.add_column(col)
    for s in st.stages:
        if s.replicas == 0:
            stages.add_row(str(s.index), str(s.layers), "0", "0", "-", "NO REPLICAS: TRAINING HALTED", style="bold white on red")
            continue
        hashes = "agree" if s.hashes_agree else "DISAGREE"
        stages.add_row(
            str(s.index), str(s.layers), str(s.replicas), f"{s.throughput:,.0f}",
            str(s.param_step) if s.param_step >= 0 else "-", hashes, style="" if s.hashes_agree else "yellow",
        )

    nodes = Table(title="nodes", title_justify="left", expand=False)
    for col in ("peer", "stage", "state", "last seen", "throughput", "queue", "step", "integrity", "checks", "reach", "path", "flags"):
        nodes.add_column(col)
    for n in st.nodes:
        nodes.add_row(
            short(n.peer_id), str(n.stage), n.state, f"{n.last_seen_s:.1f}s", f"{n.throughput:,.0f}",
            str(n.queue_len), str(n.step), _integrity(n), f"{n.checks_passed}/{n.checks_failed}" + (f" ev:{n.evidence}" if n.evidence else ""),
            n.reachability, n.path or "-", ",".join(n.flags), style="yellow" if n.flags or n.probation == "failed" else "",
        )
    parts: list[Any] = [head, verdict, progress, stages, nodes]
    if st.bans:
        bans = Table(title="banned", title_justify="left", expand=False)
        bans.add_column("peer")
        bans.add_column("reason")
        for b in st.bans:
            bans.add_row(short(b.peer_id), b.reason)
        parts.append(bans)
    return Group(*parts)


def _status(
    coordinator: Annotated[str, typer.Option("--coordinator", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    watch: Annotated[bool, typer.Option("--watch", help="Refresh in place until Ctrl-C.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the status as JSON (stable schema).")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.")] = 1.0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the coordinator.")] = 10.0,
    history: Annotated[int, typer.Option("--history", help="Closed steps of loss history to fetch.")] = 200,
) -> None:
    """Show the swarm's health: run, step, tokens/s, loss, stages, nodes, bans."""
    import trio
    from rich.console import Console
    from rich.live import Live

    from protolearn.cli.runner import run_trio
    from protolearn.coordinator.errors import Unreachable
    from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy, coordinator_peer_id
    from protolearn.protocol.errors import PeerTimeout, PeerUnavailable
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    if interval <= 0 or timeout <= 0:
        raise ConfigError(f"--interval={interval} and --timeout={timeout} must be positive")
    if not 0 <= history <= 10_000:
        raise ConfigError(f"--history={history} must be within 0..10000")
    coordinator_peer_id(coordinator)  # a malformed address is one clear line before any dialling
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # libp2p logs each failed dial as an error; the one line below says it better.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    console = Console(stderr=False)

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
                show_json(st) if json_out else console.print(render(st))
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
        with Live(render(st), console=console, auto_refresh=False) as live:
            while True:
                await trio.sleep(interval)
                try:
                    st = await link.status(history)
                    live.update(render(st), refresh=True)
                except ProtolearnError as err:
                    live.update(f"[red]coordinator unreachable: {err}; retrying[/red]", refresh=True)

    run_trio(main)


def _export(
    coordinator: Annotated[str, typer.Option("--coordinator", help="The coordinator's multiaddr, ending in /p2p/<peer id>.")],
    out: Annotated[str, typer.Option("--out", help="Model file to write; its run config goes beside it as <name>.toml.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds for the whole export.")] = 120.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Fetch every stage's current parameters from live replicas and write the whole model as one file."""

    from protolearn.cli.runner import run_trio
    from protolearn.node.coordinator_link import coordinator_peer_id
    from protolearn.node.swarm_export import export_swarm
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    if timeout <= 0:
        raise ConfigError(f"--timeout={timeout} must be positive")
    if not out or out.endswith(".toml"):
        raise ConfigError(f"--out {out!r} must name the model file (e.g. model.safetensors); its run config goes beside it as <name>.toml")
    coordinator_peer_id(coordinator)  # a malformed address is one clear line before any dialling
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def main() -> Any:
        cfg = TransportConfig(request_timeout_s=timeout, connect_timeout_s=min(timeout, 10.0))
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"], cfg) as host:
            return await export_swarm(host, coordinator, out, timeout_s=timeout)

    result = run_trio(main)
    if json_out:
        print(json.dumps({"out": str(result.out), "config": str(result.sidecar), "run": result.run.name,
                          "run_hash": result.run.run_hash(), "step": result.step, "params": result.num_params}))
    else:
        print(f"{result.run.name}: exported step {result.step} ({result.num_params} parameters) from the live swarm to {result.out}; run config {result.sidecar}")


def register(app: typer.Typer) -> None:
    swarm_app.command("status")(_status)
    swarm_app.command("export")(_export)
    app.add_typer(swarm_app, name="swarm")
