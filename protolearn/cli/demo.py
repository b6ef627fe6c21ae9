"""``protolearn demo``: a whole swarm on this machine, a coordinator and N nodes as real processes.

:class:`LocalSwarm` writes the run config, starts ``protolearn coordinator start`` and N ``protolearn node join``
processes on 127.0.0.1 (the real CLI, real libp2p), all in one process group, and stops them all on completion,
on error and on Ctrl-C, so nothing is left behind. The demo shows the swarm status live (the same view as
``swarm status --watch``) and ends with a summary: loss from start to end, tokens/s and wall time (bench_swarm.py uses the class too).

With ``--chaos``, a :class:`~protolearn.cli.chaos.ChaosPlan` (plain object: ``tick(now, closed_steps)`` returns the next
actions) SIGKILLs a random node every few seconds, restarts it on the same data dir a moment later,
and once SIGKILLs and restarts the coordinator on the same port and data dir. Each fault is printed
with its recovery time, measured from the kill until the next step closes (the swarm trained again).
"""

from __future__ import annotations

import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.cli.chaos import ChaosPlan
from protolearn.cli.final_model import final_model_path
from protolearn.cli.links import LinkOption, LinksOption, link_flags, link_note
from protolearn.codec_spec import CODECS
from protolearn.errors import ConfigError, ProtolearnError
from protolearn.supervisor import ProcessExited, Supervisor

STARTUP_S = 120.0


class DemoError(ProtolearnError):
    """A process of the local swarm failed; the message says which and points at its log."""


@dataclass
class LocalSwarm:
    """A coordinator and ``num_nodes`` nodes (``node0``, ``node1``, ...) run by one :class:`Supervisor`, logs
    under ``workdir``."""

    workdir: Path
    run_toml: str
    num_nodes: int
    threads: int | None = 1
    node_args: list[str] = field(default_factory=list)
    # Extra arguments of single nodes (by index), e.g. an --adversary for the integrity benchmark.
    per_node_args: dict[int, list[str]] = field(default_factory=dict)
    # Extra arguments of the coordinator (they override the defaults, e.g. --log-level info).
    coordinator_args: list[str] = field(default_factory=list)
    address: str = ""
    nodes: list[subprocess.Popen] = field(default_factory=list)
    # Nodes killed on purpose (--chaos) and not yet restarted: not failures, not running.
    killed: set[int] = field(default_factory=set)
    processes: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.processes = Supervisor(self.workdir)

    @property
    def coordinator(self) -> subprocess.Popen | None:
        return self.processes.procs.get("coordinator")

    def _popen(self, args: list[str], name: str) -> subprocess.Popen:
        return self.processes.spawn(name, *args)

    def start_coordinator(self, listen: str = "/ip4/127.0.0.1/tcp/0") -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "run.toml"
        config.write_text(self.run_toml, encoding="utf-8")
        self.processes.spawn("coordinator", *Supervisor.coordinator_args(config, self.workdir / "coordinator", listen, *self.coordinator_args))

    def kill_coordinator(self) -> None:
        self.processes.kill("coordinator")

    def restart_coordinator(self) -> None:
        """Start the coordinator again on its old port and data dir (its identity and state live there)."""
        port = self.address.split("/tcp/")[1].split("/")[0]
        self.start_coordinator(f"/ip4/127.0.0.1/tcp/{port}")

    def kill_node(self, k: int) -> None:
        self.killed.add(k)
        self.processes.kill(f"node{k}")

    def restart_node(self, k: int) -> None:
        """Start node ``k`` again on the same data dir: same identity, and whatever state it kept."""
        self.nodes[k] = self._popen(self._node_args(k), f"node{k}")
        self.killed.discard(k)

    def stage_of(self, k: int) -> int | None:
        """The stage node ``k`` last built, from its event log (None before it built one)."""
        built = self.processes.events(f"node{k}", "built")
        return built[-1].get("stage") if built else None

    def poll_address(self) -> str:
        """The coordinator's address once it printed it, else ''. Raises if it died."""
        if not self.address:
            try:
                self.address = self.processes.first_line("coordinator")
            except ProcessExited as err:
                raise DemoError(str(err)) from None
        return self.address

    def _node_args(self, k: int) -> list[str]:
        return self.processes.node_args(f"node{k}", self.address, *self.node_args, *self.per_node_args.get(k, []), threads=self.threads,
                                        listen="/ip4/127.0.0.1/tcp/0")

    def start_nodes(self) -> None:
        for _ in range(len(self.nodes), self.num_nodes):
            self.start_node()

    def start_node(self) -> None:
        """Start the next node (``node<len(nodes)>``)."""
        k = len(self.nodes)
        self.nodes.append(self._popen(self._node_args(k), f"node{k}"))

    def failed_node(self) -> str:
        """A one-line description of the first node that exited with an error, or ''."""
        for k, p in enumerate(self.nodes):
            if k not in self.killed and p.poll() not in (None, 0):
                return f"node{k} exited with code {p.returncode}: {self.tail(f'node{k}')}"
        return ""

    def nodes_done(self) -> bool:
        return all(p.poll() is not None for k, p in enumerate(self.nodes) if k not in self.killed)

    def tail(self, name: str) -> str:
        return self.processes.tail(name)

    def stop(self) -> None:
        """SIGTERM every process (nodes leave gracefully), then SIGKILL whatever is left after a grace period."""
        self.processes.stop()


def demo_run_toml(config: Path | None, *, stages: int, steps: int, codec: str) -> str:
    from protolearn.stages.config import load_run_config

    run = load_run_config(config)
    warmup = min(run.optim.warmup_steps, max(1, steps // 5))
    updates: dict[str, object] = {
        "stages.num_stages": stages, "stages.layers": None, "steps": steps, "codec": codec,
        "optim.total_steps": steps, "optim.warmup_steps": warmup,
    }
    if codec.startswith("subspace") and run.subspace.rank is None:
        # The subspace codec needs a constrained model: k = D/32 (docs/HOW-IT-WORKS.md, "Compression").
        updates["subspace.rank"] = max(1, run.model.d_model // 32)
    return run.replace(**updates).to_toml()


INTERRUPTED = object()


async def _until_signalled(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` until it returns, or until SIGINT or SIGTERM arrives (then return INTERRUPTED).

    The signals cancel the watch at its next checkpoint instead of raising KeyboardInterrupt at an
    arbitrary line inside py-libp2p, which could leave the host's teardown stuck and the swarm running.
    """
    import trio

    result: Any = INTERRUPTED
    error: Exception | None = None
    async with trio.open_nursery() as nursery:

        async def body() -> None:
            nonlocal result, error
            try:
                result = await fn(*args)
            except Exception as err:  # noqa: BLE001 - re-raised below, outside the nursery's exception group
                error = err
            nursery.cancel_scope.cancel()

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            nursery.start_soon(body)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    if error is not None:
        raise error
    return result


async def watch(swarm: LocalSwarm, live: Any | None, interval_s: float = 1.0, chaos: ChaosPlan | None = None, say: Any = print) -> Any:
    """Follow the swarm until every node has exited; returns the last status seen (or None).

    With ``chaos``, apply its kills and restarts and ``say`` each fault and its recovery time.
    """
    import trio

    from protolearn.cli.status_view import render
    from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
    from protolearn.protocol.errors import ProtocolError
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host

    with trio.fail_after(STARTUP_S):
        while not swarm.poll_address():
            await trio.sleep(0.1)
    swarm.start_nodes()
    last = None
    async with open_host(Identity.generate()) as host:
        link = CoordinatorLink(host, swarm.address, retry=RetryPolicy(retry_for_s=5.0, request_timeout_s=5.0))
        while True:
            failed = swarm.failed_node()
            if failed:
                raise DemoError(failed)
            try:
                status = await link.status(loss_history=10_000)
            except ProtocolError:
                status = None
            if status is not None:
                last = status
                # Once the last step has closed the nodes leave; keep showing the last view that had them.
                if live is not None and (status.nodes or status.verdict == "finished"):
                    live.update(render(status))
            if chaos is not None:
                closed = len(last.loss_history) if last is not None else 0
                await _apply_chaos(swarm, chaos, closed, say)
            if swarm.nodes_done():
                return last
            await trio.sleep(interval_s)


def _is_back(swarm: LocalSwarm, target: str) -> bool:
    """A restarted node has applied a step again (so it holds its stage's state: killing its stage-mate
    now loses nothing); a restarted coordinator printed its address."""
    if target == "coordinator":
        out = swarm.workdir / "coordinator.out"
        return out.exists() and out.read_text(encoding="utf-8").endswith("\n")
    k = int(target.removeprefix("node"))
    path = swarm.workdir / target / "node.jsonl"
    if swarm.nodes[k].poll() is not None or not path.exists():
        return False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    # The restarted process's own start (until it writes one, the log ends with the killed one's steps).
    pid = f'"pid": {swarm.nodes[k].pid}'
    starts = [i for i, ln in enumerate(lines) if '"event": "start"' in ln and pid in ln]
    return bool(starts) and any('"event": "step"' in ln for ln in lines[starts[-1]:])


async def _apply_chaos(swarm: LocalSwarm, chaos: ChaosPlan, closed: int, say: Any) -> None:
    import trio

    alive = {k for k, p in enumerate(swarm.nodes) if p.poll() is None and k not in swarm.killed}
    stages = {k: swarm.stage_of(k) for k in alive}
    back = {f.target for f in chaos.faults if f.restarted_at is not None and not f.back and _is_back(swarm, f.target)}
    for action, arg in chaos.tick(time.monotonic(), closed, stages, alive, back):
        if action == "kill":
            if arg == "coordinator":
                await trio.to_thread.run_sync(swarm.kill_coordinator)
                say(f"chaos: SIGKILL coordinator after step {closed}")
            else:
                k = int(arg.removeprefix("node"))
                await trio.to_thread.run_sync(swarm.kill_node, k)
                say(f"chaos: SIGKILL {arg} (stage {stages.get(k)}) after step {closed}")
        elif action == "restart":
            if arg == "coordinator":
                swarm.restart_coordinator()
            else:
                swarm.restart_node(int(arg.removeprefix("node")))
            say(f"chaos: restarted {arg} on its data dir")
        elif action == "recovered":
            say(f"chaos: {arg.target} fault recovered in {arg.recovered_s:.1f} s (from the SIGKILL until the next step closed)")


def _demo(
    nodes: Annotated[int, typer.Option("--nodes", help="Node processes to start.")] = 2,
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages (at most the model's layers).")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps to train.")] = 40,
    codec: Annotated[str, typer.Option("--codec", help=f"Activation/gradient codec: {', '.join(CODECS)} (topk:F sends the fraction F; subspace constrains the model to rank D/32 unless the config sets [subspace] rank).")] = "none",
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the built-in demo run).")] = None,
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where logs and state go (default: a new temp dir).")] = None,
    threads: Annotated[int, typer.Option("--threads", help="Torch threads per node.")] = 1,
    chaos: Annotated[bool, typer.Option("--chaos", help="SIGKILL and restart random nodes (and once the coordinator) while training.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --chaos's choice of victims.")] = 0,
    link: LinkOption = None, links: LinksOption = None,  # emulated home links (protolearn/cli/links.py)
) -> None:
    """Run a whole swarm on this machine: a coordinator and N nodes over libp2p on 127.0.0.1."""
    import trio
    from rich.console import Console
    from rich.live import Live

    if nodes < stages:
        raise ConfigError(f"--nodes={nodes} is fewer than --stages={stages}; every stage needs at least one node")
    if stages < 1 or steps < 1 or threads < 1:
        raise ConfigError(f"--stages, --steps and --threads must be at least 1 (got {stages}, {steps}, {threads})")
    if chaos and nodes < stages + 1:
        raise ConfigError(f"--chaos needs a stage with two replicas to kill one of: use --nodes of at least {stages + 1} (got {nodes})")
    run_toml = demo_run_toml(config, stages=stages, steps=steps, codec=codec)
    work = workdir or Path(tempfile.mkdtemp(prefix="protolearn-demo-"))
    console = Console(stderr=True)
    console.print(f"demo: {nodes} nodes, {stages} stages, {steps} steps, codec {codec}{link_note(link, links)}; logs in {work}")
    swarm = LocalSwarm(work, run_toml, nodes, threads=threads, per_node_args=link_flags(nodes, link, links))
    t0, status, plan = time.monotonic(), None, None
    try:
        swarm.start_coordinator()
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            plan = ChaosPlan(nodes, steps, random.Random(seed)) if chaos else None
            status = trio.run(_until_signalled, watch, swarm, live, 0.25 if chaos else 1.0, plan, live.console.print)
        if not console.is_terminal:  # the last frame ends without a newline there: end it, or the next line joins it
            console.line()
        if status is INTERRUPTED:
            raise KeyboardInterrupt
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; one that lands before the watch starts is a plain KeyboardInterrupt
        console.print("interrupted: stopping the swarm")
        raise typer.Exit(130) from None
    finally:
        swarm.stop()
    wall = time.monotonic() - t0
    history = list(status.loss_history) if status is not None else []
    if len(history) < steps:
        raise DemoError(f"the swarm finished only {len(history)} of {steps} steps; see the logs in {work}")
    span, tokens = max(1e-9, history[-1].closed_at - history[0].closed_at), status.run.tokens_per_step * (len(history) - 1)
    if (model := final_model_path(work / "coordinator")).exists():
        print(f"demo: the trained model is {model}; sample text from it: protolearn generate --model {model} --prompt 'def '")
    print(f"demo: loss {history[0].loss:.3f} -> {history[-1].loss:.3f} over {len(history)} steps; "
          f"{tokens / span:,.0f} tokens/s; wall time {wall:.1f} s; logs in {work}")
    if plan is not None:
        for f in plan.faults:
            rec = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "not recovered before the run ended"
            print(f"chaos: {f.target} killed after step {f.closed_at_kill}: recovered in {rec} (SIGKILL to next step closed)")


def register(app: typer.Typer) -> None:
    app.command("demo")(_demo)
