"""Bench suite ``hivemind``: hivemind's ``DecentralizedAverager`` all-reducing one tensor over N loopback peers.

The baseline for the ``recovery`` suite's ``allreduce_s`` / ``allreduce_with_failure_s`` (issue 6).
It is run as a new user would: hivemind==1.1.12 with torch==2.13.0 and numpy<2.4 in its own venv,
``.bench-venv/hivemind`` (created here when missing; hivemind's wheel ships its p2pd binary). Each
peer is ``scripts/hivemind_peer.py`` run by that venv's python, in its own session, so SIGKILL of its
process group takes its DHT, averager and p2pd processes down together. Peers listen on 127.0.0.1
only, with NAT port mapping, AutoNAT and relays off, and bootstrap from the previous peer (chained).

One swarm runs per ``--timeouts NEXT_CHUNK,ALLREDUCE`` value (``next_chunk_timeout`` and
``allreduce_timeout`` in seconds, ``none`` for hivemind's default of no timeout), one after the other.
Each runs a warm-up round and then a failure round, in which peer ``--kill-index`` is SIGKILLed
``--kill-at`` of the way through a normal round. The first swarm also runs ``--rounds`` timed rounds
before its failure round: ``hivemind_allreduce_s`` is their median, and its failure round gives
``hivemind_allreduce_with_failure_s``; ``hivemind_failures`` describes every failure round.

A round is timed from the trigger (every peer has formed the group and waits at
``require_trigger``; matchmaking is not timed) to the last survivor's result. Peer ``i`` contributes
``(k % 3) + 2**i`` at element ``k``, so each survivor's result says, element by element, whose
contributions it holds: that is how ``parts`` reports what happened to the dead peer's part.
Every wait is bounded; all peer process groups are killed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from protolearn.errors import ProtolearnError

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".bench-venv" / "hivemind"
PEER = REPO / "scripts" / "hivemind_peer.py"
# As a new user installs it; hivemind's 8-bit decompression breaks on numpy 2.4.
PINS = ("torch==2.13.0", "hivemind==1.1.12", "numpy<2.4")
INSTALL_TIMEOUT_S = 1800
START_TIMEOUT_S = 90
QUIT_TIMEOUT_S = 10


# (next_chunk_timeout, allreduce_timeout): the small timeouts; a next_chunk_timeout short
# enough for a round to finish without the dead peer inside allreduce_timeout; hivemind's defaults.
DEFAULT_TIMEOUTS = ("2,5", "1,15", "none,none")


class HivemindBenchError(ProtolearnError):
    """The hivemind baseline could not be installed or run."""


def parse_timeouts(text: str) -> tuple[float | None, float | None]:
    """'NEXT_CHUNK,ALLREDUCE' in seconds, either may be 'none' -> (next_chunk_timeout, allreduce_timeout)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--timeouts {text!r} must be NEXT_CHUNK,ALLREDUCE, e.g. 2,5 or none,none")
    try:
        values = tuple(None if x.strip().lower() == "none" else float(x) for x in parts)
    except ValueError:
        raise ValueError(f"--timeouts {text!r}: each must be seconds or 'none'") from None
    if any(v is not None and v <= 0 for v in values):
        raise ValueError(f"--timeouts {text!r}: seconds must be positive")
    return values  # type: ignore[return-value]


def timeouts_label(timeouts: tuple[float | None, float | None]) -> str:
    return f"next_chunk_timeout={timeouts[0]},allreduce_timeout={timeouts[1]}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py hivemind", description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4, help="number of peers (default 4; at most 4 so parts stay decodable)")
    p.add_argument("--mb", type=float, default=64.0, help="tensor size in MB of float32 (default 64: 16M elements)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    p.add_argument("--timeouts", action="append", default=None, metavar="NEXT_CHUNK,ALLREDUCE",
                   help="one swarm per value, each with a failure round: seconds, or 'none' for hivemind's default "
                        "(no timeout); the first also runs the timed rounds (default: 2,5 then 1,15 then none,none)")
    p.add_argument("--kill-index", type=int, default=2, help="the peer SIGKILLed in the failure rounds")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill after this fraction of the median round time")
    p.add_argument("--round-deadline", type=float, default=60.0, help="give up on a round after this many seconds")
    p.add_argument("--venv", type=Path, default=VENV, help=f"hivemind venv (default {VENV.relative_to(REPO)})")
    args = p.parse_args(argv)
    try:
        args.timeouts = [parse_timeouts(t) for t in (args.timeouts or DEFAULT_TIMEOUTS)]
    except ValueError as err:
        p.error(str(err))
    if not 2 <= args.peers <= 4:
        p.error(f"--peers={args.peers} must be 2..4")
    if not 0 <= args.kill_index < args.peers:
        p.error(f"--kill-index={args.kill_index} must name one of the {args.peers} peers")
    if args.rounds < 1 or args.mb <= 0 or not 0 < args.kill_at < 1:
        p.error("--rounds must be >= 1, --mb > 0 and --kill-at in (0, 1)")
    return args


def ensure_venv(venv: Path) -> Path:
    """The venv's python, with hivemind importable; (re)creates the venv and installs PINS if needed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import hivemind, torch"]
    if python.exists() and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
        return python
    print(f"bench hivemind: installing {' '.join(PINS)} into {venv} (once)", file=sys.stderr)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)], [str(python), "-m", "pip", "install", "-q", *PINS]]
    for cmd in steps:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise HivemindBenchError(f"'{' '.join(cmd[:4])} ...' took over {INSTALL_TIMEOUT_S}s; check the network and retry") from None
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise HivemindBenchError(f"installing the hivemind venv failed ({last}); remove {venv} and retry")
    return python


class Peer:
    """One hivemind_peer.py process: commands on its stdin, '@@ ' JSON events read by a thread into a queue."""

    def __init__(self, python: Path, index: int, peer_args: list[str], log_dir: Path) -> None:
        self.index = index
        self.log = log_dir / f"peer-{index}.log"
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(PEER), "--index", str(index), *peer_args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.killed_at: float | None = None
        self.maddrs: list[str] = []  # set from its "ready" event
        threading.Thread(target=self._read, name=f"hivemind-peer-{index}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.events.put(json.loads(line[3:]))
        self.events.put(None)  # EOF: the peer exited

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; the caller sees that as a missing event

    def wait_event(self, deadline: float) -> dict[str, Any] | None:
        """The next event, or None if the peer exited or the deadline (time.monotonic) passed."""
        try:
            return self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def kill(self) -> None:
        """SIGKILL the whole session: the peer, its DHT and averager processes, and p2pd."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        self.proc.wait(timeout=QUIT_TIMEOUT_S)

    def describe_failure(self) -> str:
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
        return f"peer {self.index} (exit {self.proc.poll()}): {' | '.join(tail)[-400:]}"


@contextmanager
def swarm(python: Path, args: argparse.Namespace, timeouts: list[str], log_dir: Path) -> Iterator[list[Peer]]:
    numel = int(args.mb * 2**20) // 4
    log_dir.mkdir()
    peers: list[Peer] = []
    try:
        for i in range(args.peers):
            chain = [a for m in (peers[-1].maddrs if peers else []) for a in ("--initial-peer", m)]
            peer = Peer(python, i, ["--numel", str(numel), "--group-size", str(args.peers), *chain, *timeouts,
                                    "--round-timeout", str(args.round_deadline)], log_dir)
            peers.append(peer)
            ev = peer.wait_event(time.monotonic() + START_TIMEOUT_S)
            if ev is None or ev["event"] != "ready":
                raise HivemindBenchError(f"hivemind peer did not start: {peer.describe_failure()}")
            peer.maddrs = ev["maddrs"]
        yield peers
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                peer.send("quit")
        end = time.monotonic() + QUIT_TIMEOUT_S
        for peer in peers:
            try:
                peer.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed below
            peer.kill()  # always: a clean exit can still leave p2pd behind


def subset_labels(num_peers: int) -> dict[str, str]:
    """'%.3f' of mean(2**j for j in S) -> 'j+k+..' for every non-empty subset S of the peers (all distinct)."""
    labels: dict[str, str] = {}
    for r in range(1, num_peers + 1):
        for s in itertools.combinations(range(num_peers), r):
            labels[f"{sum(2**j for j in s) / len(s):.3f}"] = "+".join(map(str, s))
    return labels


def run_round(peers: list[Peer], r: int, deadline_s: float, kill: Peer | None = None, kill_after: float = 0.0) -> dict[str, Any]:
    """One round among the live peers; with ``kill``, SIGKILL it ``kill_after`` s after the trigger."""
    live = [p for p in peers if p.proc.poll() is None]
    deadline = time.monotonic() + deadline_s
    for p in live:
        p.send(f"round {r}")
    for p in live:
        ev = p.wait_event(deadline)
        if ev is None or ev["event"] != "awaiting":
            raise HivemindBenchError(f"round {r}: no group formed: {ev or p.describe_failure()}")
    t_go = time.time()
    for p in live:
        p.send("go")
    if kill is not None:
        time.sleep(kill_after)
        kill.kill()
        kill.killed_at = time.time()
    # A peer gives up on its result after deadline_s (and says so); wait a little longer for it to say it.
    deadline = time.monotonic() + deadline_s + 15
    done = {p.index: p.wait_event(deadline) for p in live if p is not kill}
    finished = [ev for ev in done.values() if ev is not None]
    labels = subset_labels(len(peers))
    read = [ev for ev in finished if ev["codes"] is not None]  # None: tensors still locked by the all-reduce
    return {
        "seconds": (max(ev["t_done"] for ev in finished) - t_go) if finished else None,
        "finished": sorted(i for i, ev in done.items() if ev is not None),
        "hung": sorted(i for i, ev in done.items() if ev is None),
        "errors": {i: ev["error"] for i, ev in done.items() if ev is not None and ev["error"]},
        "tensors_locked": sorted(i for i, ev in done.items() if ev is not None and ev["codes"] is None),
        "identical": len({ev["digest"] for ev in read}) == 1 and len(read) == len(done),
        # per survivor: whose contributions its result holds, as fractions of the tensor
        "parts": {i: {labels.get(c, f"?{c}"): round(n / sum(ev["codes"].values()), 4) for c, n in ev["codes"].items()}
                  for i, ev in done.items() if ev is not None and ev["codes"] is not None},
    }


def failure_summary(rnd: dict[str, Any], dead: int) -> dict[str, Any]:
    """What happened to the dead peer's contribution, for each survivor."""
    dead_in = {i: round(sum(f for label, f in parts.items() if str(dead) in label.split("+")), 4)
               for i, parts in rnd["parts"].items()}
    own_only = {i: parts.get(str(i), 0.0) for i, parts in rnd["parts"].items()}
    return {**rnd, "killed": dead, "dead_peer_in_fraction": dead_in, "kept_own_values_fraction": own_only,
            "completed": not rnd["hung"] and not rnd["errors"]}


def run(argv: list[str]) -> dict:
    args = parse_args(argv)
    python = ensure_venv(args.venv)
    result: dict[str, Any] = {"peers": args.peers, "mb": args.mb, "hivemind": "1.1.12", "killed_peer": args.kill_index}
    failures: dict[str, Any] = {}
    kill_after = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-hivemind-") as tmp:
        log_dir = Path(tmp)
        try:
            for n, timeouts in enumerate(args.timeouts):
                flags = [a for flag, v in zip(("--next-chunk-timeout", "--allreduce-timeout"), timeouts, strict=True) if v is not None for a in (flag, str(v))]
                with swarm(python, args, flags, log_dir / f"swarm-{n}") as peers:
                    run_round(peers, 0, args.round_deadline)  # warm-up
                    r = 1
                    if n == 0:
                        rounds = [run_round(peers, r, args.round_deadline) for r in range(1, args.rounds + 1)]
                        bad = [x for x in rounds if x["seconds"] is None or x["errors"] or not x["identical"]]
                        if bad:
                            raise HivemindBenchError(f"a fault-free hivemind round failed: {bad[0]}")
                        median = statistics.median(x["seconds"] for x in rounds)
                        result["hivemind_allreduce_s"] = median
                        result["hivemind_allreduce_rounds_s"] = [round(x["seconds"], 3) for x in rounds]
                        kill_after = args.kill_at * median
                        result["kill_after_s"] = round(kill_after, 3)
                        r = args.rounds + 1
                    fail = failure_summary(run_round(peers, r, args.round_deadline, peers[args.kill_index], kill_after), args.kill_index)
                    if n == 0:
                        result["hivemind_allreduce_with_failure_s"] = fail["seconds"]
                    label = timeouts_label(timeouts)
                    failures[label if label not in failures else f"{label} #{n}"] = fail
        except HivemindBenchError as err:
            logs = "; ".join(f"{p.name}: {' | '.join(p.read_text(errors='replace').splitlines()[-2:])[-300:]}" for p in sorted(log_dir.glob("*/*.log")))
            raise HivemindBenchError(f"{err} [logs: {logs}]") from None
    result["hivemind_failures"] = failures
    return result
