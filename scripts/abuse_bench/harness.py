"""How the abuse bench measures: a target process it drives, and honest operations timed without and with an attack.

A target is a separate process (so that its memory is its own: :meth:`Target.rss`) that takes one JSON
command a line on its stdin and answers one JSON line on its stdout. Per attack, :func:`measure` times the
honest operations first without the attack and then with it running (side by side in one run, since the
machine is shared and noisy), and reports:

- ``honest_ok``: every honest operation succeeded, with and without the attack (the attack's row may add the
  outcome it checks afterwards);
- ``latency_ratio``: median honest latency under attack / without it (the worst of the attack's operations);
- ``mem_growth_bytes``: the **target process's RSS** (``/proc/<pid>/status`` VmRSS) at the end of the attack
  minus before it;
- what the target's gates refused and how many temporary bans they gave meanwhile (``<gate>_rejected``,
  ``<gate>_temp_bans``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, NamedTuple

import trio

SEED = 20261130
STOP_S = 3.0
# The folder that holds this package: a target process imports it from there.
SCRIPTS = Path(__file__).resolve().parent.parent


class Sizes(NamedTuple):
    numel: int = 256 * 1024  # the stream target's stage vector: 1 MiB of float32
    identities: int = 5
    idle_per_identity: int = 24
    trickles_per_identity: int = 8
    flood_parts: int = 40
    offers: int = 12
    hellos: int = 60
    sybils: int = 40
    honest_ops: int = 8
    rounds: int = 3
    window_s: float = 4.0  # each honest measurement lasts at least this long
    # The member attacks (issue 27): honest training steps per measurement, and the Sybils of each attack.
    steps: int = 3
    swarm_numel: int = 64 * 1024  # a swarm replica's gradient vector
    role_sybils: int = 4
    report_sybils: int = 4
    steering_tries: int = 40
    poll_sybils: int = 5
    swarm_warm_up: bool = True  # one untimed step before each member attack's baseline (new members' first dials)


QUICK = Sizes(numel=64 * 1024, identities=2, idle_per_identity=20, trickles_per_identity=3, flood_parts=10, offers=6,
              hellos=24, sybils=6, honest_ops=3, rounds=2, window_s=0.5, steps=1, swarm_numel=16 * 1024, role_sybils=2,
              report_sybils=2, steering_tries=8, poll_sybils=5, swarm_warm_up=False)


class Target:
    """A target process, driven by JSON lines on its stdin/stdout. Several tasks may ask at once: each command
    carries an ``id`` that its answer repeats, and whichever task waits reads the answers for all of them."""

    def __init__(self, proc: trio.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self._buf = b""
        self._ids = 0
        self._answers: dict[int, dict] = {}
        self._reading = False
        self._arrived = trio.Event()
        self._sending = trio.Lock()

    async def read(self, timeout: float = 60.0) -> dict:
        """The next line the target writes."""
        assert self.proc.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buf:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    raise RuntimeError(f"the target process exited; see its log {self.log_path}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def ask(self, cmd: str, timeout: float = 60.0, **args: Any) -> dict:
        assert self.proc.stdin is not None
        self._ids += 1
        me = self._ids
        async with self._sending:
            await self.proc.stdin.send_all(json.dumps({"cmd": cmd, "id": me, **args}).encode() + b"\n")
        with trio.fail_after(timeout):
            while me not in self._answers:
                if self._reading:
                    await self._arrived.wait()
                    continue
                self._reading = True
                try:
                    answer = await self.read(timeout)
                    self._answers[answer.pop("id", me)] = answer
                finally:
                    self._reading = False
                    self._arrived.set()
                    self._arrived = trio.Event()
        return self._answers.pop(me)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    async def stop(self) -> None:
        """Ask it to stop, and end it if it has not within a few seconds (nothing it does then is measured)."""
        with trio.move_on_after(STOP_S):
            if self.proc.stdin is not None:
                try:
                    await self.proc.stdin.send_all(b'{"cmd": "stop"}\n')
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def start_target(module: str, args: list[str], log_path: Path) -> tuple[Target, dict]:
    """Start ``python -m abuse_bench.<module> ARGS`` and read the line it says once it is ready."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log_path, "wb") as log_file:
        proc = await trio.lowlevel.open_process([sys.executable, "-m", f"abuse_bench.{module}", *args], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=log_file, env=env)
    target = Target(proc, log_path)
    try:
        ready = await target.read(timeout=120)
    except BaseException:
        await target.stop()
        raise
    return target, ready


Op = Callable[[], Awaitable[bool]]


def honest_step(target: Target, log: list[dict] | None = None) -> Op:
    """The op "the swarm target's honest swarm trains one step" (see swarm_target.py); a step that fails says what it
    waited on, on stderr under ``honest step failed:`` (the test shows those lines). ``log`` keeps every answer."""

    async def step() -> bool:
        r = await target.ask("step", timeout=150)
        if log is not None:
            log.append(r)
        if not r["ok"]:
            print(f"honest step failed: {json.dumps(r)}", file=sys.stderr)
        return bool(r["ok"])

    return step


# With ``until``, the honest ops go on at most this many times longer than they would without it.
UNTIL_ROUNDS = 8


async def timed(ops: dict[str, Op], n: int, window_s: float = 0.0, op_timeout_s: float = 30.0,
                until: trio.Event | None = None) -> tuple[bool, dict[str, float]]:
    """Run the honest ops in turn, each at least ``n`` times, until ``window_s`` has passed and ``until`` (if given)
    is set (but at most :data:`UNTIL_ROUNDS` times ``n``); their median times."""
    from protolearn.errors import ProtolearnError

    ok = True
    samples: dict[str, list[float]] = {name: [] for name in ops}
    end = trio.current_time() + window_s
    for _ in range(10_000):
        done = all(len(v) >= n for v in samples.values()) and trio.current_time() >= end
        if done and (until is None or until.is_set() or all(len(v) >= UNTIL_ROUNDS * n for v in samples.values())):
            break
        for name, op in ops.items():
            t0 = trio.current_time()
            try:
                with trio.fail_after(op_timeout_s):
                    good = await op()
            except (ProtolearnError, trio.TooSlowError) as err:
                print(f"honest {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
                good = False
            ok = ok and good
            samples[name].append(trio.current_time() - t0)
        await trio.sleep(0.05)  # an honest node's pace, not a flood of its own
    return ok, {name: statistics.median(v) for name, v in samples.items()}


async def measure(target: Target, ops: dict[str, Op], n: int, window_s: float, attack: Callable[..., Awaitable[None]], *,
                  op_timeout_s: float = 30.0, warm_up: bool = True, until: trio.Event | None = None) -> dict:
    """Time ``ops`` (``n`` times each, for at least ``window_s``) without and then with ``attack`` running.

    ``attack(task_status=...)`` calls ``task_status.started()`` once it is under way, and runs until cancelled;
    with ``until``, the ops under attack go on until it is set too (an attack that has a course to run)."""
    t0 = trio.current_time()
    if warm_up:
        await timed(ops, 1, op_timeout_s=op_timeout_s)  # first dials, the lane's first connection: not counted
    base_ok, base = await timed(ops, n, window_s, op_timeout_s)
    before = await target.ask("stats")
    rss0 = target.rss()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(90):
            await nursery.start(attack)
        under_ok, under = await timed(ops, n, window_s, op_timeout_s, until)
        rss1 = target.rss()
        after = await target.ask("stats")
        nursery.cancel_scope.cancel()
    ratio = max(under[k] / max(base[k], 1e-6) for k in ops)
    gates = {f"{k}_{what}": after[k][what] - before[k][what] for k in after for what in after[k]}
    return {"honest_ok": base_ok and under_ok, "latency_ratio": round(ratio, 3), "mem_growth_bytes": rss1 - rss0, **gates,
            "honest_ms": {k: round(1000 * under[k], 2) for k in ops}, "baseline_ms": {k: round(1000 * base[k], 2) for k in ops},
            "wall_s": round(trio.current_time() - t0, 1)}


async def hosts(stack: AsyncExitStack, n: int, peers: dict[str, str]) -> list[Any]:
    """``n`` fresh identities' hosts on loopback, each told where ``peers`` (peer id -> address) listen."""
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import open_host

    out = [await stack.enter_async_context(open_host(Identity.generate())) for _ in range(n)]
    for h in out:
        for pid, addr in peers.items():
            h.add_peer_addrs(pid, [addr])
    return out


def quiet(*errors: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What an attacker's own failed dials and refused requests raise (it keeps going)."""
    from libp2p.exceptions import BaseLibp2pError

    from protolearn.errors import ProtolearnError

    return (ProtolearnError, BaseLibp2pError, OSError, trio.TooSlowError, *errors)


def split_addr(addr: str) -> tuple[str, str]:
    """A full multiaddr's (address without /p2p/, peer id)."""
    base, _, peer = addr.rpartition("/p2p/")
    return base, peer
