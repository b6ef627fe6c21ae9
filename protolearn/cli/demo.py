"""``protolearn demo``: a whole swarm on this machine, a coordinator and N nodes as real processes.

:class:`LocalSwarm` writes the run config, starts ``protolearn coordinator start`` and N ``protolearn
node join`` processes on 127.0.0.1 (the real CLI, real libp2p), all in one process group, and stops
them all on completion, on error and on Ctrl-C, so nothing is left behind. The demo shows the swarm
status live (the same view as ``swarm status --watch``) and ends with a summary: loss from start to
end, tokens/s and wall time. ``scripts/bench_swarm.py`` uses the same class.

With ``--chaos``, a :class:`ChaosPlan` (plain object: ``tick(now, closed_steps)`` returns the next
actions) SIGKILLs a random node every few seconds, restarts it on the same data dir a moment later,
and once SIGKILLs and restarts the coordinator on the same port and data dir. Each fault is printed
with its recovery time, measured from the kill until the next step closes (the swarm trained again).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from protolearn.codec_spec import CODECS
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
    # Extra arguments of single nodes (by index), e.g. an --adversary for the integrity benchmark.
    per_node_args: dict[int, list[str]] = field(default_factory=dict)
    address: str = ""
    coordinator: subprocess.Popen | None = None
    nodes: list[subprocess.Popen] = field(default_factory=list)
    # Nodes killed on purpose (--chaos) and not yet restarted: not failures, not running.
    killed: set[int] = field(default_factory=set)
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

    def start_coordinator(self, listen: str = "/ip4/127.0.0.1/tcp/0") -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "run.toml"
        config.write_text(self.run_toml, encoding="utf-8")
        self.coordinator = self._popen(
            ["coordinator", "start", "--config", str(config), "--listen", listen,
             "--data-dir", str(self.workdir / "coordinator"), "--log-level", "warning"], "coordinator")

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def restart_coordinator(self) -> None:
        """Start the coordinator again on its old port and data dir (its identity and state live there)."""
        port = self.address.split("/tcp/")[1].split("/")[0]
        self.start_coordinator(f"/ip4/127.0.0.1/tcp/{port}")

    def kill_node(self, k: int) -> None:
        self.killed.add(k)
        self.nodes[k].send_signal(signal.SIGKILL)
        self.nodes[k].wait()

    def restart_node(self, k: int) -> None:
        """Start node ``k`` again on the same data dir: same identity, and whatever state it kept."""
        self.nodes[k] = self._popen(self._node_args(k), f"node{k}")
        self.killed.discard(k)

    def stage_of(self, k: int) -> int | None:
        """The stage node ``k`` last built, from its event log (None before it built one)."""
        path = self.workdir / f"node{k}" / "node.jsonl"
        if not path.exists():
            return None
        stage = None
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if '"built"' in line:
                try:
                    stage = json.loads(line).get("stage")
                except json.JSONDecodeError:
                    continue  # a line cut off by a SIGKILL
        return stage

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

    def _node_args(self, k: int) -> list[str]:
        args = ["node", "join", "--coordinator", self.address, "--device", "cpu", "--listen", "/ip4/127.0.0.1/tcp/0",
                "--data-dir", str(self.workdir / f"node{k}"), "--name", f"node{k}", *self.node_args, *self.per_node_args.get(k, [])]
        if self.threads:
            args += ["--threads", str(self.threads)]
        return args

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


@dataclass
class Fault:
    """One SIGKILL of ``target`` (``node<k>`` or ``coordinator``) and what followed."""

    target: str
    killed_at: float
    closed_at_kill: int
    restarted_at: float | None = None
    # The restarted process is in the swarm again (a node joined; the coordinator answers).
    back: bool = False
    # Seconds from the kill until the next step closed.
    recovered_s: float | None = None


@dataclass
class ChaosPlan:
    """Decides when to kill and restart what (sans-IO: :meth:`tick` returns actions, the caller does them).

    One fault at a time: the next comes ``interval_s`` after the previous one recovered. A node is only
    killed if its stage keeps another live replica; the ``coordinator_fault``-th fault (counting from 0)
    is the coordinator. No fault is started in the last ``quiet_steps`` steps, so the run can end.
    """

    num_nodes: int
    steps: int
    rng: random.Random
    interval_s: float = 4.0
    restart_after_s: float = 1.0
    coordinator_fault: int = 1
    quiet_steps: int = 3
    faults: list[Fault] = field(default_factory=list)
    _next_at: float | None = None

    def tick(
        self, now: float, closed_steps: int, stages: dict[int, int | None], alive: set[int], back: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> list[tuple[str, Any]]:
        """Actions: ("recovered", fault), ("restart", target), ("kill", target).

        ``back`` names restarted targets seen in the swarm again; no new fault starts before every
        restarted target is back (a node still joining would fail to reach a killed coordinator).
        """
        actions: list[tuple[str, Any]] = []
        for f in self.faults:
            if f.restarted_at is not None and not f.back and f.target in back:
                f.back = True
                self._next_at = max(self._next_at or now, now + self.interval_s)
            if f.recovered_s is None and closed_steps > f.closed_at_kill:
                f.recovered_s = now - f.killed_at
                self._next_at = now + self.interval_s
                actions.append(("recovered", f))
            if f.restarted_at is None and now - f.killed_at >= self.restart_after_s:
                f.restarted_at = now
                actions.append(("restart", f.target))
        if any(f.recovered_s is None or not f.back for f in self.faults):
            return actions
        if closed_steps < 2 or closed_steps >= self.steps - self.quiet_steps:
            return actions
        if self._next_at is None:
            self._next_at = now + self.interval_s
        if now < self._next_at:
            return actions
        self._next_at = now + self.interval_s
        if len(self.faults) == self.coordinator_fault:
            target = "coordinator"
        else:
            per_stage: dict[int, int] = {}
            for k in alive:
                st = stages.get(k)
                if st is not None:
                    per_stage[st] = per_stage.get(st, 0) + 1
            # Killing a stage's last replica would stall the run: chaos tests recovery, not loss of a stage.
            candidates = sorted(k for k in alive if stages.get(k) is not None and per_stage[stages[k]] >= 2)  # type: ignore[index]
            if not candidates:
                return actions
            target = f"node{self.rng.choice(candidates)}"
        self.faults.append(Fault(target, now, closed_steps))
        actions.append(("kill", target))
        return actions


def demo_run_toml(config: Path | None, *, stages: int, steps: int, codec: str) -> str:
    from protolearn.stages.config import load_run_config

    run = load_run_config(config)
    warmup = min(run.optim.warmup_steps, max(1, steps // 5))
    updates: dict[str, object] = {
        "stages.num_stages": stages, "stages.layers": None, "steps": steps, "codec": codec,
        "optim.total_steps": steps, "optim.warmup_steps": warmup,
    }
    if codec.startswith("subspace") and run.subspace.rank is None:
        # The subspace codec needs a constrained model: k = D/32 (README "Compression").
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
    console.print(f"demo: {nodes} nodes, {stages} stages, {steps} steps, codec {codec}; logs in {work}")
    swarm = LocalSwarm(work, run_toml, nodes, threads=threads)
    t0 = time.monotonic()
    status = None
    plan: ChaosPlan | None = None
    try:
        swarm.start_coordinator()
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            plan = ChaosPlan(nodes, steps, random.Random(seed)) if chaos else None
            status = trio.run(_until_signalled, watch, swarm, live, 0.25 if chaos else 1.0, plan, live.console.print)
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
    span = max(1e-9, history[-1].closed_at - history[0].closed_at)
    tokens = status.run.tokens_per_step * (len(history) - 1)
    print(f"demo: loss {history[0].loss:.3f} -> {history[-1].loss:.3f} over {len(history)} steps; "
          f"{tokens / span:,.0f} tokens/s; wall time {wall:.1f} s; logs in {work}")
    if plan is not None:
        for f in plan.faults:
            rec = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "not recovered before the run ended"
            print(f"chaos: {f.target} killed after step {f.closed_at_kill}: recovered in {rec} (SIGKILL to next step closed)")


def register(app: typer.Typer) -> None:
    app.command("demo")(_demo)
