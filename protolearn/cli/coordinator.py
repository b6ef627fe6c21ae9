"""``protolearn coordinator start``: run the coordinator of a training run.

Prints exactly one line on stdout, the multiaddr (with ``/p2p/<peer id>``) to paste into
``protolearn node join`` on other machines: with a wildcard ``--listen``, the ``--announce`` address if
given, else the address of a real interface (the default route's first; never loopback while another
exists). Everything else goes to stderr: which address is which, the other addresses it listens on,
and the log. One process per data dir (a lock); a start that fails on a fresh data dir leaves nothing
that claims its run. When the run's last step commits, the coordinator fetches the final model from
the replicas into ``<data dir>/final`` (:mod:`protolearn.cli.final_model`), so ``swarm export`` works
after every node has left.
Identity and state live in ``--data-dir``, so a restart with the same data dir is the same
coordinator with the same members, step, leases and bans. When ``--listen`` asks for port 0 and the
data dir remembers a port, that port is reused, so nodes reconnect to the address they know. Ctrl-C or
SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from protolearn.errors import ConfigError

if TYPE_CHECKING:
    from protolearn.protocol.link import LinkSpec

coordinator_app = typer.Typer(help="Run the coordinator of a training run.", no_args_is_help=True)

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
# How long to wait for a remembered port that is still busy after a crash.
PORT_WAIT_S = 30.0
# How often to look again: nodes are retrying, so every moment the port is free but unused counts.
PORT_RETRY_S = 0.2
log = logging.getLogger("protolearn.coordinator")
# File descriptors besides the members' connections: listeners, SQLite, the checker's dials, logs.
OTHER_FILES = 1024


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


def _forget_fresh_state(data_dir: Path) -> None:
    """A start that failed on a fresh data dir must not leave the dir claiming its run (the next start,
    with another --config, would be refused): remove the store it created."""
    from protolearn.coordinator.store import DB_FILE

    for suffix in ("", "-wal", "-shm", "-journal"):
        (data_dir / f"{DB_FILE}{suffix}").unlink(missing_ok=True)


def _start(
    config: Annotated[Path | None, typer.Option("--config", metavar="FILE", help="Run config TOML (default: the run in --data-dir, else the built-in demo run).")] = None,
    listen: Annotated[str, typer.Option("--listen", metavar="MULTIADDR", help="Multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/7700.")] = DEFAULT_LISTEN,
    announce: Annotated[list[str] | None, typer.Option(
        "--announce", metavar="MULTIADDR",
        help="The address other machines reach this coordinator at, when no interface holds it (port forwarding, a public IP on the router), e.g. /ip4/203.0.113.5/tcp/7700; printed first; repeatable.",
    )] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", metavar="DIR", help="Identity and state (default: ~/.protolearn/coordinator); one process per data dir.")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", metavar="PORT", help="Serve Prometheus metrics on this port (0: any free port).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", metavar="LEVEL", help="debug, info, warning or error.")] = "info",
    ban_on_evidence: Annotated[bool, typer.Option(
        "--ban-on-evidence", help="Ban a member at once when a report proves it signed two contradicting statements (off by default).",
    )] = False,
    relay: Annotated[bool, typer.Option(
        "--relay", help="Also relay traffic for nodes behind NATs (circuit relay v2) and offer this coordinator to them as their relay.",
    )] = False,
    link: Annotated[str | None, typer.Option(
        "--link", metavar="SPEC", help="Emulate a home link for the coordinator's traffic too (RATE,DELAY[,JITTER]); off by default: it carries no tensors.",
    )] = None,
    wait_for: Annotated[int, typer.Option(
        "--wait-for", metavar="N", help="Lease no ticket of the first step until N nodes have joined (default 1: start at once).",
    )] = 1,
    lease_s: Annotated[float | None, typer.Option(
        "--lease-s", help="Ticket lease term in seconds (tests and benchmarks shrink it; default 20).", hidden=True,
    )] = None,
) -> None:
    """Start the coordinator and print the address nodes join with."""
    from protolearn.data_dir_lock import DataDirLock
    from protolearn.protocol.identity import default_data_dir
    from protolearn.protocol.link import parse_link
    from protolearn.protocol.transport.config import usable_link

    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level={log_level!r} is not one of debug, info, warning, error")
    if lease_s is not None and not lease_s > 0:
        raise ConfigError(f"--lease-s={lease_s} must be a positive number of seconds")
    if wait_for < 1:
        raise ConfigError(f"--wait-for={wait_for} must be at least 1 node")
    if metrics_port is not None and not 0 <= metrics_port < 65536:
        raise ConfigError(f"--metrics-port={metrics_port} is not a TCP port (0-65535)")
    spec = usable_link(parse_link(link)) if link is not None else None
    data_dir = data_dir or default_data_dir("coordinator")
    with DataDirLock(data_dir, what="--data-dir"):
        _serve(config, listen, announce or [], data_dir, metrics_port, log_level, ban_on_evidence, relay, lease_s, spec, wait_for)


def _serve(
    config: Path | None, listen: str, announce: list[str], data_dir: Path, metrics_port: int | None, log_level: str,
    ban_on_evidence: bool, relay: bool, lease_s: float | None, link: LinkSpec | None, wait_for: int,
) -> None:
    import trio

    from protolearn.cli.final_model import keep_final_model
    from protolearn.cli.logs import configure_stderr_logging
    from protolearn.cli.runner import run_trio
    from protolearn.coordinator.config import CoordinatorSettings
    from protolearn.coordinator.service import Running, persisted_run_toml, serve
    from protolearn.protocol.addresses import PortInUse
    from protolearn.protocol.identity import load_or_create_identity
    from protolearn.protocol.interfaces import dialable, parse_announce
    from protolearn.stages.config import RunConfig, load_run_config

    configure_stderr_logging(log_level)
    settings = CoordinatorSettings(
        ban_on_evidence=ban_on_evidence, keep_final=True, start_members=wait_for, **({} if lease_s is None else {"lease_s": lease_s}),
    )
    _raise_open_files(settings.max_connections + OTHER_FILES)
    saved = persisted_run_toml(data_dir)
    if config is None:
        run = RunConfig.from_toml_text(saved, source=f"run saved in {data_dir}") if saved else load_run_config(None)
    else:
        run = load_run_config(config)
    peer_id = load_or_create_identity(data_dir).peer_id
    for addr in announce:
        parse_announce(addr, peer_id)  # a malformed --announce is one line before anything starts
    listen_on = _with_port(listen, data_dir)
    wildcard = "/ip4/0.0.0.0/" in listen_on
    metrics_host = "0.0.0.0" if wildcard else "127.0.0.1"
    printed = False

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
                        settings=settings,
                        relay=relay, announce=announce, link=link, task_status=task_status,
                    )
                )
            except PortInUse as err:
                if trio.current_time() >= deadline:
                    raise
                if not warned:
                    log.warning("%s; waiting up to %.0f s for it", err, deadline - trio.current_time())
                    warned = True
                await trio.sleep(PORT_RETRY_S)

    async def keep_heap() -> None:
        from protolearn.coordinator.heap import HeapKeeper

        keeper = HeapKeeper(time.monotonic())
        keeper.install()
        try:
            while True:
                await trio.sleep(keeper.due_s(time.monotonic()))
                keeper.tick(time.monotonic())
        finally:
            keeper.uninstall()

    async def main() -> None:
        nonlocal printed
        async with trio.open_nursery() as nursery:
            running = await start_service(nursery)
            _remember_port(data_dir, running.addrs)
            port = running.addrs[0].split("/")[4]
            heard = [f"/ip4/0.0.0.0/tcp/{port}"] if wildcard else running.addrs
            addrs = dialable(heard, running.peer_id, announce=announce)
            print(addrs[0].addr, flush=True)
            printed = True
            _say_addresses(addrs, wildcard)
            await nursery.start(keep_final_model, running, addrs[-1].addr, addrs[0].addr)
            nursery.start_soon(keep_heap)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s; shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        run_trio(main)
    except BaseException:
        if saved is None and not printed:
            _forget_fresh_state(data_dir)
        raise


def _raise_open_files(wanted: int) -> None:
    """Every member holds a connection, i.e. a file descriptor: raise the soft limit on open files toward
    ``wanted`` (up to the hard limit), and say so when the hard limit is lower."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning("open files are limited to %d (ulimit -Hn): the coordinator holds at most about %d member connections",
                    target, max(0, target - OTHER_FILES))


def _say_addresses(addrs: list, wildcard: bool) -> None:
    """Say on stderr which printed address is which: the one to paste, and where else it listens."""
    first = addrs[0]
    if first.note == "this machine only" and wildcard:
        log.warning("no network interface besides loopback: other machines cannot reach %s; pass --announce ADDR", first.addr)
    log.info("nodes on other machines join with: protolearn node join --coordinator %s  (%s)", first.addr, first.note)
    for other in addrs[1:]:
        log.info("also reachable at %s  (%s)", other.addr, other.note)


def register(app: typer.Typer) -> None:
    coordinator_app.command("start")(_start)
    app.add_typer(coordinator_app, name="coordinator")
