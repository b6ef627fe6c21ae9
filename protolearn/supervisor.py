"""The processes of a swarm on one machine: the real CLI as subprocesses, each with its log files, one group.

``protolearn demo``, the benchmarks and the end-to-end tests all start their coordinators and nodes
through one :class:`Supervisor`, so a swarm is started, watched and stopped the same way everywhere:

- a process named ``name`` writes ``<workdir>/<name>.out`` and ``.err``; a node's event log is
  ``<workdir>/<name>/node.jsonl`` when its data dir is ``<workdir>/<name>`` (as :meth:`node_args` makes it);
- every process joins one process group of its own (the first one's), so a Ctrl-C at the terminal reaches
  the parent only, which then stops the swarm: :meth:`stop` signals every process it started;
- a coordinator's first line on stdout is its address (:meth:`first_line`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protolearn.errors import ProtolearnError

CLI = [sys.executable, "-m", "protolearn.cli.main"]
STOP_GRACE_S = 10.0


class ProcessExited(ProtolearnError):
    """A supervised process exited while something waited on it; the message names it and its last line."""


class Supervisor:
    """Named subprocesses of this one, with their logs under ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self._pgid: int | None = None

    def spawn(self, name: str, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
        """Start ``protolearn ARGS`` as ``name`` (``prefix``, e.g. ``ip netns exec NS``, runs it elsewhere)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [*prefix, *CLI, *args]
        with (self.workdir / f"{name}.out").open("w") as out, (self.workdir / f"{name}.err").open("w") as err:
            kwargs: dict[str, Any] = dict(stdout=out, stderr=err, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                proc = subprocess.Popen(argv, process_group=self._pgid if self._pgid is not None else 0, **kwargs)
            except PermissionError:  # every process of the group has exited: this one leads a new group
                proc = subprocess.Popen(argv, process_group=0, **kwargs)
                self._pgid = None
        if self._pgid is None:
            self._pgid = proc.pid
        self.procs[name] = proc
        return proc

    @staticmethod
    def coordinator_args(config: Path, data_dir: Path, listen: str = "/ip4/127.0.0.1/tcp/0", *extra: str) -> list[str]:
        return ["coordinator", "start", "--config", str(config), "--listen", listen, "--data-dir", str(data_dir),
                "--log-level", "warning", *extra]

    def node_args(self, name: str, coordinator: str, *extra: str, threads: int | None = 1, listen: str | None = None) -> list[str]:
        """``node join`` of a CPU node called ``name`` with its data dir ``<workdir>/<name>`` (``extra`` last, so it
        may override any of these)."""
        args = ["node", "join", "--coordinator", coordinator, "--device", "cpu", "--data-dir", str(self.workdir / name), "--name", name]
        args += ["--listen", listen] if listen else []
        args += ["--threads", str(threads)] if threads else []
        return [*args, *extra]

    def first_line(self, name: str) -> str:
        """The first whole line ``name`` printed on stdout, or '' while there is none; raises if it exited."""
        text = (self.workdir / f"{name}.out").read_text(encoding="utf-8", errors="replace")
        if "\n" in text:
            return text.splitlines()[0].strip()
        code = self.procs[name].poll()
        if code is not None:
            raise ProcessExited(f"{name} exited with code {code}: {self.tail(name)}")
        return ""

    def wait_first_line(self, name: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not (line := self.first_line(name)):
            if time.monotonic() > deadline:
                raise ProcessExited(f"{name} printed no line in {timeout:.0f} s: {self.tail(name)}")
            time.sleep(0.05)
        return line

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` and reap it."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def err(self, name: str, chars: int = 3000) -> str:
        """The last ``chars`` characters of ``name``'s stderr."""
        path = self.workdir / f"{name}.err"
        return path.read_text(encoding="utf-8", errors="replace")[-chars:] if path.exists() else ""

    def tail(self, name: str) -> str:
        """``name``'s last non-empty stderr line, and where its log is."""
        lines = [ln for ln in self.err(name, 20_000).splitlines() if ln.strip()]
        return (lines[-1] if lines else "(no output)") + f" (log: {self.workdir / f'{name}.err'})"

    def events(self, name: str, event: str | None = None) -> list[dict]:
        """The records of ``<workdir>/<name>/node.jsonl`` (of one ``event`` kind if given); none before the
        log exists, and a line a SIGKILL cut off is skipped."""
        path = self.workdir / name / "node.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event is None or record.get("event") == event:
                out.append(record)
        return out

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM everything (nodes leave gracefully), then SIGKILL whatever is left after ``grace_s``."""
        procs = list(self.procs.values())
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            live = [p for p in procs if p.poll() is None]
            if not live:
                break
            for p in live:
                p.send_signal(sig)  # a no-op for one that exited meanwhile (Popen knows it reaped it)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
