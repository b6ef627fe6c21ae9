"""`protolearn demo` as a user runs it: a whole swarm on this machine, a summary, and no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.support.cli import CLI
from tests.support.swarm import DEMO_TOML as TINY



def _pids(workdir: Path) -> list[int]:
    """The node processes the demo started (each logs its pid)."""
    pids = []
    for log in workdir.glob("node*/node.jsonl"):
        for line in log.read_text().splitlines():
            d = json.loads(line)
            if d["event"] == "start":
                pids.append(d["pid"])
    return pids


def _survivors(workdir: Path) -> list[str]:
    """Live processes whose command line mentions the demo's workdir (coordinator and nodes)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(workdir) in cmd and _alive(int(proc.name)):
            found.append(cmd)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_all_gone(pids: list[int], workdir: Path, timeout: float = 15.0) -> None:
    """Fail unless the demo's node processes (``pids``) and any process of ``workdir`` are gone within ``timeout``.

    The demo waits for its nodes and coordinator before it exits, but a signal to their process group
    reaches any process of theirs asynchronously; an orphan, the failure this catches, stays for good.
    """
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)] or _survivors(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes outlived the demo: {left}"


def test_demo_trains_and_prints_a_summary(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    work = tmp_path / "demo"
    r = subprocess.run([*CLI, "demo", "--nodes", "3", "--stages", "2", "--steps", "6", "--config", str(config), "--workdir", str(work)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # The live view's last frame ends its line: with stdout and stderr on one terminal or log, the summary
    # lines start lines of their own.
    assert r.stderr.endswith("\n"), r.stderr[-300:]
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("demo: loss ") and "over 6 steps" in summary and "tokens/s" in summary, summary
    first, last = (float(x) for x in summary.split("loss ")[1].split(" over")[0].split(" -> "))
    assert last < first
    pids = _pids(work)
    assert len(pids) == 3
    _wait_all_gone(pids, work)


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    work = tmp_path / "demo"
    demo = subprocess.Popen([*CLI, "demo", "--nodes", "2", "--steps", "5000", "--config", str(config), "--workdir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            logs = list(work.glob("node*/node.jsonl"))
            if len(logs) == 2 and all('"event": "step"' in p.read_text() for p in logs):
                break
            assert demo.poll() is None, demo.communicate()[1][-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("the demo's nodes did not train a step within 180 s")
        pids = _pids(work)
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 130, err[-3000:]
        assert "interrupted" in err
        _wait_all_gone(pids, work)
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.communicate()  # reap it and close its pipes
