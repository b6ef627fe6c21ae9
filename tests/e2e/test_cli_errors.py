"""Mistakes on the command line are one ``error:`` line and exit code 1, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from protolearn.protocol.identity import Identity

from tests.support.cli import CLI, PROTOLEARN, cli, one_error_line

COORD = f"/ip4/127.0.0.1/tcp/7700/p2p/{Identity.generate().peer_id}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "{tmp}/bad.toml"], "d_model=250 is not divisible by n_heads=8"),
        (["--config", "{tmp}/missing.toml"], "not found"),
        (["--data", "{tmp}/empty"], "needs at least 2"),
        (["--data", "{tmp}/unreadable"], "2 unreadable file(s) or folder(s): a.txt, b.txt (check their permissions)"),
        (["--steps", "0"], "--steps=0 must be at least 1"),
    ],
)
def test_cli_reports_bad_config_in_one_line(args: list[str], expected: str, tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[model]\nd_model = 250\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unreadable").mkdir()
    for name in ("a.txt", "b.txt"):  # broken links: unreadable even for root
        (tmp_path / "unreadable" / name).symlink_to(tmp_path / "nowhere" / name)
    argv = [str(PROTOLEARN), "train-local", *[a.format(tmp=tmp_path) for a in args], "--log", str(tmp_path / "l.jsonl")]
    line = one_error_line(subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path))
    assert expected in line, line


def test_cli_rejects_a_bad_relay_via_in_one_line(tmp_path: Path) -> None:
    line = one_error_line(cli("node", "join", "--coordinator", COORD, "--relay-via", "/ip4/1.2.3.4/tcp/4001", "--data-dir", str(tmp_path),
                              cwd=tmp_path))
    assert line.startswith("error: --relay-via: ") and "/p2p/<peer id>" in line, line


def test_unreachable_coordinator_is_one_line_and_exit_1(tmp_path: Path) -> None:
    addr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"
    r = subprocess.run([*CLI, "node", "join", "--coordinator", addr, "--data-dir", str(tmp_path / "n"), "--coordinator-wait", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot reach the coordinator")
    bad = subprocess.run([*CLI, "node", "join", "--coordinator", "localhost:7700"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "must be a full multiaddr" in bad.stderr and "Traceback" not in bad.stderr


def test_coordinator_wait_for_zero_is_one_line_and_exit_1(tmp_path: Path) -> None:
    argv = [str(PROTOLEARN), "coordinator", "start", "--wait-for", "0", "--data-dir", str(tmp_path / "coord")]
    line = one_error_line(subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path))
    assert "--wait-for=0 must be at least 1 node" in line, line
