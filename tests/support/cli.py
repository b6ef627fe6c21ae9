"""The ``protolearn`` command as a user runs it: a real subprocess of this interpreter's install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The module form works from any working directory; PROTOLEARN is the console script pip installed.
CLI = [sys.executable, "-m", "protolearn.cli.main"]
PROTOLEARN = Path(sys.executable).with_name("protolearn")


def cli(*args: str, cwd: Path | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``protolearn ARGS`` to completion (within ``timeout``), capturing its output as text."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)


def one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The single ``error: ...`` line a failed command must print, with exit code 1 and no traceback."""
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.stderr, out.stderr[-2000:]
    return lines[0]


def the_error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The one ``error: ...`` line a refused command prints after any progress lines of its own; no traceback."""
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def swarm_status(addr: str, *extra: str) -> dict:
    """``swarm status --json`` of the coordinator at ``addr`` (it must answer)."""
    out = cli("swarm", "status", "--coordinator", addr, "--json", *extra, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def join_node(addr: str, data_dir: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``node join`` of a CPU node with one thread, run to its end (within ``timeout``)."""
    return cli("node", "join", "--coordinator", addr, "--data-dir", str(data_dir), "--device", "cpu", "--threads", "1", *extra, timeout=timeout)
