"""A volunteer's first day, as real processes: one identity per process, and one clear line for every
ordinary mistake (never a traceback), while a running swarm keeps committing steps.

The swarm is test_swarm's (a coordinator and two nodes through the CLI, on 127.0.0.1). Every refused
attempt is a real ``protolearn`` process; after the attempts the swarm must have gone on committing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import CLI, join_node, swarm_status, the_error_line
from tests.support.swarm import Swarm, TINY

DEADLINE_S = 180.0


def wait_committed(addr: str, at_least: int, timeout: float = DEADLINE_S) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = swarm_status(addr)
        if st["last_committed"] >= at_least:
            return st
        assert time.monotonic() < deadline, f"step {at_least} did not commit in {timeout:.0f} s: {st['verdict']} {st['verdict_reason']}"
        time.sleep(0.5)


@pytest.fixture
def running(tmp_path: Path):
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=100_000, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    try:
        addr = s.start_coordinator()
        s.start_node("n0", addr)
        s.start_node("n1", addr)
        wait_committed(addr, 2)
        yield s, addr
    finally:
        s.stop()


def test_one_identity_is_one_process_and_the_swarm_never_stops_for_it(running, tmp_path: Path) -> None:
    s, addr = running
    before = swarm_status(addr)["last_committed"]

    # A second process on a running node's data dir: refused by the lock, naming the first process.
    second = join_node(addr, tmp_path / "n0", "--name", "n0")
    assert second.returncode == 1
    line = the_error_line(second)
    assert f"in use by process {s.procs['n0'].pid}" in line and "--name (or --data-dir)" in line, line

    # The coordinator's data dir (what --name coordinator with default paths is): refused by its lock too.
    on_coordinator = join_node(addr, tmp_path / "coord", "--name", "coordinator")
    assert on_coordinator.returncode == 1 and f"in use by process {s.procs['coord'].pid}" in the_error_line(on_coordinator)

    # The coordinator's identity key copied elsewhere (no lock can see that): refused before it dials.
    stolen = tmp_path / "stolen"
    stolen.mkdir(mode=0o700)
    shutil.copy(tmp_path / "coord" / "identity.key", stolen / "identity.key")
    as_coordinator = join_node(addr, stolen, "--name", "thief")
    assert as_coordinator.returncode == 1 and "the coordinator's own peer id" in the_error_line(as_coordinator)

    # A live member's identity key copied to another data dir (another machine's copy): the coordinator
    # refuses it while the member is connected (after the node retried for a few seconds).
    twin = tmp_path / "twin"
    twin.mkdir(mode=0o700)
    shutil.copy(tmp_path / "n1" / "identity.key", twin / "identity.key")
    copy = join_node(addr, twin, "--name", "twin", "--coordinator-wait", "5")
    assert copy.returncode == 1
    line = the_error_line(copy)
    assert "refused to let this node join" in line and "one identity runs in one process" in line, line

    # None of it touched the swarm: both nodes still train, and steps keep committing.
    after = wait_committed(addr, before + 3)
    assert s.procs["n0"].poll() is None and s.procs["n1"].poll() is None, s.err("n0") + s.err("n1")
    assert sorted(n["name"] for n in after["nodes"]) == ["n0", "n1"]
    assert after["verdict"] == "healthy", after["verdict_reason"]
    for name in ("n0", "n1"):
        assert not s.events(name, "step_lost") and "not_member" not in (tmp_path / name / "node.log").read_text()


def test_ordinary_mistakes_are_one_line_each_and_a_failed_start_leaves_nothing_behind(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        data = tmp_path / "coord"
        taken = subprocess.run([*CLI, "coordinator", "start", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data),
                                "--metrics-port", str(port)], capture_output=True, text=True, timeout=120)
        assert taken.returncode == 1
        assert f"--metrics-port {port}" in the_error_line(taken)
        # That failed start claimed no run: the same data dir starts another run's coordinator.
        assert not (data / "coordinator.sqlite").exists()
        listen = subprocess.run([*CLI, "coordinator", "start", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--data-dir", str(data)],
                                capture_output=True, text=True, timeout=120)
        assert listen.returncode == 1 and "cannot listen on" in the_error_line(listen)
    config = tmp_path / "other.toml"
    config.write_text(TINY.format(steps=3, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    try:
        s.start_coordinator()  # the same data dir, another run: not refused
    finally:
        s.stop()

    addr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"
    gpu = join_node(addr, tmp_path / "g", "--device", "cuda:1", "--coordinator-wait", "0")
    assert gpu.returncode == 1 and "--device cuda:1" in the_error_line(gpu)
    bad = "/ip4/127.0.0.1/tcp/7700/p2p/12D3KooWnotapeerid"
    st = subprocess.run([*CLI, "swarm", "status", "--coordinator", bad], capture_output=True, text=True, timeout=60)
    assert st.returncode == 1
    assert the_error_line(st).count(bad) == 1
    (tmp_path / "a-file").write_text("x")
    unwritable = join_node(addr, tmp_path / "a-file" / "n", "--coordinator-wait", "0")
    assert unwritable.returncode == 1 and "cannot use data dir" in the_error_line(unwritable)


def test_ctrl_c_while_waiting_for_the_coordinator_is_not_a_clean_leave(tmp_path: Path) -> None:
    addr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"
    proc = subprocess.Popen([*CLI, "node", "join", "--coordinator", addr, "--data-dir", str(tmp_path / "n"), "--coordinator-wait", "120"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 90
        seen = ""
        while "waiting for the coordinator" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, seen + rest
    assert "stopped before this node joined" in rest and "leaving the swarm" not in rest and "Traceback" not in rest


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="a small tmpfs for the full disk needs root")
def test_a_full_disk_under_a_node_says_so_once_and_training_goes_on(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True, timeout=30)
    config = tmp_path / "run.toml"
    # Many more steps than filling the disk takes, so the disk is full well before the run ends (with 30 a
    # one-layer node on a quiet machine finished before the filler did).
    steps = 200
    config.write_text(TINY.format(steps=steps, codec="none", layers=1, stages=1))
    s = Swarm(tmp_path, config)
    try:
        addr = s.start_coordinator()
        node = s.spawn("full", "node", "join", "--coordinator", addr, "--data-dir", str(disk / "full"), "--name", "full",
                       "--device", "cpu", "--threads", "1", "--checkpoint-every", "2")
        deadline = time.monotonic() + DEADLINE_S
        while not (disk / "full" / "node.jsonl").exists() or '"event": "step"' not in (disk / "full" / "node.jsonl").read_text():
            assert time.monotonic() < deadline and node.poll() is None, s.err("full")
            time.sleep(0.2)
        filler = disk / "filler"
        # Fill the disk to the last byte, unbuffered: a buffered file's close would flush again and raise.
        with filler.open("wb", buffering=0) as f:
            try:
                for _ in range(4 * 1024 * 1024 // 4096 + 1):  # 4 KiB writes: more than the 4 MiB disk holds
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        assert node.wait(timeout=DEADLINE_S) == 0, s.err("full")
        assert swarm_status(addr)["last_committed"] == steps - 1  # it trained to the end with a full disk
        err = (tmp_path / "full.err").read_text(errors="replace")
        assert "Traceback" not in err and "Logging error" not in err, err
        assert err.count("stopped writing the event log") == 1, err
        # A checkpoint came due after the disk filled (so the node trained on past it) and was not written.
        assert err.count("checkpoint not written") == 1 and "the disk is full" in err, err
    finally:
        s.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)
