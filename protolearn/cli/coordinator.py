"""``protolearn coordinator start``: run the coordinator of a training run.

Prints exactly one line on stdout, the multiaddr (with ``/p2p/<peer id>``) to paste into
``protolearn node join``; everything else (other reachable addresses, the log) goes to stderr.
Identity and state live in ``--data-dir``, so a restart with the same data dir is the same
coordinator with the same members, step, leases and bans. When ``--listen`` asks for port 0 and the
data dir remembers a port, that port is reused, so nodes reconnect to the address they know. Ctrl-C or
SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from protolearn.errors import ConfigError

coordinator_app = typer.Typer(help="Run the coordinator of a training run.", no_args_is_help=True)

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
# How long to wait for a remembered port that is still busy after a crash.
PORT_WAIT_S = 30.0
# How often to look again: nodes are retrying, so every moment the port is free but unused counts.
PORT_RETRY_S = 0.2
log = logging.getLogger("protolearn.coordinator")




def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # libp2p logs every connection-manager tick at INFO.
    logging.getLogger("libp2p").setLevel(logging.WARNING)


def _interface_ips() -> list[str]:
    """Non-loopback IPv4 addresses of this machine, found without sending anything."""
    ips: list[str] = []
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return ips
    for info in infos:
        ip = str(info[4][0])
        if not ip.startswith("127.") and ip not in ips:
            ips.append(ip)
    return ips


def _with_port(listen: str, data_dir: Path) -> str:
    """Reuse the port remembered in the data dir when ``listen`` asks for any port."""
    from protolearn.coordinator.store import DB_FILE, Store

    parts = listen.split("/")
    if "tcp" not in parts or parts[parts.index("tcp") + 1 :][:1] != ["0"] or not (data_dir / DB_FILE).exists():
        return listen
    store = Store(data_dir)
    try:
        port = store.get_meta("listen_port")
    finally:
        store.close()
    if port is None:
        return listen
    parts[parts.index("tcp") + 1] = port
    return "/".join(parts)


def _remember_port(data_dir: Path, addrs: list[str]) -> None:
    from protolearn.coordinator.store import Store

    parts = addrs[0].split("/")
    if "tcp" in parts:
        store = Store(data_dir)
        try:
            store.set_meta("listen_port", parts[parts.index("tcp") + 1])
        finally:
            store.close()


def _start(
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the run in --data-dir, else the built-in demo run).")] = None,
    listen: Annotated[str, typer.Option("--listen", help="Multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/7700.")] = DEFAULT_LISTEN,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Identity and state (default: ~/.protolearn/coordinator).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
    ban_on_evidence: Annotated[bool, typer.Option(
        "--ban-on-evidence", help="Ban a member at once when a report proves it signed two contradicting statements (off by default).",
    )] = False,
    relay: Annotated[bool, typer.Option(
        "--relay", help="Also relay traffic for nodes behind NATs (circuit relay v2) and offer this coordinator to them as their relay.",
    )] = False,
    lease_s: Annotated[float | None, typer.Option(
        "--lease-s", help="Ticket lease term in seconds (tests and benchmarks shrink it; default 20).", hidden=True,
    )] = None,
) -> None:
    """Start the coordinator and print the address nodes join with."""
    import trio

    from protolearn.cli.runner import run_trio
    from protolearn.coordinator.config import CoordinatorSettings
    from protolearn.coordinator.service import Running, persisted_run_toml, serve
    from protolearn.protocol.addresses import PortInUse
    from protolearn.protocol.identity import default_data_dir
    from protolearn.stages.config import RunConfig, load_run_config

    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level={log_level!r} is not one of debug, info, warning, error")
    if lease_s is not None and not lease_s > 0:
        raise ConfigError(f"--lease-s={lease_s} must be a positive number of seconds")
    if metrics_port is not None and not 0 <= metrics_port < 65536:
        raise ConfigError(f"--metrics-port={metrics_port} is not a TCP port (0-65535)")
    setup_logging(log_level)
    data_dir = data_dir or default_data_dir("coordinator")
    if config is None:
        saved = persisted_run_toml(data_dir)
        run = RunConfig.from_toml_text(saved, source=f"run saved in {data_dir}") if saved else load_run_config(None)
    else:
        run = load_run_config(config)
    listen_on = _with_port(listen, data_dir)
    metrics_host = "0.0.0.0" if "/ip4/0.0.0.0/" in listen_on else "127.0.0.1"

    async def start_service(nursery: trio.Nursery) -> Running:
        # A remembered port is busy while the previous coordinator is still shutting down (sockets in
        # TIME_WAIT do not count: see check_port_free), and nodes only know that port, so wait for it
        # rather than move to another.
        deadline = trio.current_time() + (PORT_WAIT_S if listen_on != listen else 0.0)
        warned = False
        while True:
            try:
                return await nursery.start(
                    lambda task_status: serve(
                        run, data_dir, listen_on, metrics_port=metrics_port, metrics_host=metrics_host,
                        settings=CoordinatorSettings(ban_on_evidence=ban_on_evidence, **({} if lease_s is None else {"lease_s": lease_s})),
                        relay=relay, task_status=task_status,
                    )
                )
            except PortInUse as err:
                if trio.current_time() >= deadline:
                    raise
                if not warned:
                    log.warning("%s; waiting up to %.0f s for it", err, deadline - trio.current_time())
                    warned = True
                await trio.sleep(PORT_RETRY_S)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            running = await start_service(nursery)
            _remember_port(data_dir, running.addrs)
            print(running.addrs[0], flush=True)
            if "/ip4/0.0.0.0/" in listen_on:
                tail = running.addrs[0].split("/", 3)[3]  # tcp/<port>/p2p/<id>
                for ip in _interface_ips():
                    log.info("reachable from other machines at /ip4/%s/%s", ip, tail)
            if running.metrics_port is not None:
                log.info("metrics at http://%s:%d/metrics", metrics_host, running.metrics_port)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s; shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    run_trio(main)


def register(app: typer.Typer) -> None:
    coordinator_app.command("start")(_start)
    app.add_typer(coordinator_app, name="coordinator")
