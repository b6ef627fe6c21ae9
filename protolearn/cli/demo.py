"""``protolearn demo``: a whole swarm on this machine, a coordinator and N nodes as real processes.

:class:`LocalSwarm` writes the run config, starts ``protolearn coordinator start`` and N ``protolearn
node join`` processes on 127.0.0.1 (the real CLI, real libp2p), all in one process group, and stops
them all on completion, on error and on Ctrl-C, so nothing is left behind. The demo shows the swarm
status live (the same view as ``swarm status --watch``) and ends with a summary: loss from start to
end, tokens/s and wall time. ``scripts/bench_swarm.py`` uses the same class.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.errors import ConfigError, ProtolearnError

CLI = [sys.executable, "-m", "protolearn.cli.main"]
STARTUP_S = 120.0
STOP_GRACE_S = 10.0


class DemoError(ProtolearnError):
    """A process of the local swarm failed; the message says which and points at its log."""


@dataclass
class LocalSwarm:
    """A coordinator and ``num_nodes`` nodes as subprocesses of this one, logs under ``workdir``."""

    workdir: Path
    run_toml: str
    num_nodes: int
    threads: int | None = 1
    node_args: list[str] = field(default_factory=list)
    address: str = ""
    coordinator: subprocess.Popen | None = None
    nodes: list[subprocess.Popen] = field(default_factory=list)
    _pgid: int | None = None

    def _popen(self, args: list[str], name: str) -> subprocess.Popen:
        out = (self.workdir / f"{name}.out").open("w")
        err = (self.workdir / f"{name}.err").open("w")
        # One process group for the whole swarm: stop() signals it at once and leaves no orphan.
        kwargs: dict[str, Any] = {"process_group": self._pgid if self._pgid is not None else 0}
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)
        out.close()
        err.close()
        if self._pgid is None:
            self._pgid = proc.pid
        return proc

    def start_coordinator(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "run.toml"
        config.write_text(self.run_toml, encoding="utf-8")
        self.coordinator = self._popen(
            ["coordinator", "start", "--config", str(config), "--listen", "/ip4/127.0.0.1/tcp/0",
             "--data-dir", str(self.workdir / "coordinator"), "--log-level", "warning"], "coordinator")

    def poll_address(self) -> str:
        """The coordinator's address once it printed it, else ''. Raises if it died."""
        if self.address:
            return self.address
        text = (self.workdir / "coordinator.out").read_text(encoding="utf-8")
        if text.endswith("\n"):
            self.address = text.splitlines()[0].strip()
            return self.address
        assert self.coordinator is not None
        if self.coordinator.poll() is not None:
            raise DemoError(f"the coordinator exited with code {self.coordinator.returncode}: {self.tail('coordinator')}")
        return ""

    def start_nodes(self) -> None:
        for k in range(self.num_nodes):
            args = ["node", "join", "--coordinator", self.address, "--device", "cpu", "--listen", "/ip4/127.0.0.1/tcp/0",
                    "--data-dir", str(self.workdir / f"node{k}"), "--name", f"node{k}", *self.node_args]
            if self.threads:
                args += ["--threads", str(self.threads)]
            self.nodes.append(self._popen(args, f"node{k}"))

    def failed_node(self) -> str:
        """A one-line description of the first node that exited with an error, or ''."""
        for k, p in enumerate(self.nodes):
            if p.poll() not in (None, 0):
                return f"node{k} exited with code {p.returncode}: {self.tail(f'node{k}')}"
        return ""

    def nodes_done(self) -> bool:
        return all(p.poll() is not None for p in self.nodes)

    def tail(self, name: str) -> str:
        path = self.workdir / f"{name}.err"
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()] if path.exists() else []
        return (lines[-1] if lines else "(no output)") + f" (log: {path})"

    def stop(self) -> None:
        """SIGTERM the group (nodes leave gracefully), then SIGKILL whatever is left after a grace period."""
        procs = [p for p in [*self.nodes, self.coordinator] if p is not None]
        if self._pgid is None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            if all(p.poll() is not None for p in procs):
                break
            try:
                os.killpg(self._pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def demo_run_toml(config: Path | None, *, stages: int, steps: int, codec: str) -> str:
    from protolearn.stages.config import load_run_config

    run = load_run_config(config)
    warmup = min(run.optim.warmup_steps, max(1, steps // 5))
    return run.replace(**{
        "stages.num_stages": stages, "stages.layers": None, "steps": steps, "codec": codec,
        "optim.total_steps": steps, "optim.warmup_steps": warmup,
    }).to_toml()


async def watch(swarm: LocalSwarm, live: Any | None, interval_s: float = 1.0) -> Any:
    """Follow the swarm until every node has exited; returns the last status seen (or None)."""
    import trio

    from protolearn.cli.swarm import render
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
                if live is not None and status.nodes:
                    live.update(render(status))
            if swarm.nodes_done():
                return last
            await trio.sleep(interval_s)


def _demo(
    nodes: Annotated[int, typer.Option("--nodes", help="Node processes to start.")] = 2,
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages (at most the model's layers).")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps to train.")] = 40,
    codec: Annotated[str, typer.Option("--codec", help="Activation/gradient codec: none, fp16, bf16, int8, topk.")] = "none",
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML (default: the built-in demo run).")] = None,
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where logs and state go (default: a new temp dir).")] = None,
    threads: Annotated[int, typer.Option("--threads", help="Torch threads per node.")] = 1,
) -> None:
    """Run a whole swarm on this machine: a coordinator and N nodes over libp2p on 127.0.0.1."""
    import trio
    from rich.console import Console
    from rich.live import Live

    if nodes < stages:
        raise ConfigError(f"--nodes={nodes} is fewer than --stages={stages}; every stage needs at least one node")
    if stages < 1 or steps < 1 or threads < 1:
        raise ConfigError(f"--stages, --steps and --threads must be at least 1 (got {stages}, {steps}, {threads})")
    run_toml = demo_run_toml(config, stages=stages, steps=steps, codec=codec)
    work = workdir or Path(tempfile.mkdtemp(prefix="protolearn-demo-"))
    console = Console(stderr=True)
    console.print(f"demo: {nodes} nodes, {stages} stages, {steps} steps, codec {codec}; logs in {work}")
    swarm = LocalSwarm(work, run_toml, nodes, threads=threads)
    t0 = time.monotonic()
    status = None
    try:
        swarm.start_coordinator()
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            status = trio.run(watch, swarm, live)  # Ctrl-C arrives here as KeyboardInterrupt
    except KeyboardInterrupt:
        console.print("interrupted: stopping the swarm")
        raise typer.Exit(130) from None
    finally:
        swarm.stop()
    wall = time.monotonic() - t0
    history = list(status.loss_history) if status is not None else []
    if len(history) < steps:
        raise DemoError(f"the swarm finished only {len(history)} of {steps} steps; see the logs in {work}")
    span = max(1e-9, history[-1].closed_at - history[0].closed_at)
    tokens = status.run.tokens_per_step * (len(history) - 1)
    print(f"demo: loss {history[0].loss:.3f} -> {history[-1].loss:.3f} over {len(history)} steps; "
          f"{tokens / span:,.0f} tokens/s; wall time {wall:.1f} s; logs in {work}")


def register(app: typer.Typer) -> None:
    app.command("demo")(_demo)
