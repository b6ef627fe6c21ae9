"""Two machines whose training data differ must not train one model: the second node is refused.

The run's ``data.path`` is relative, so each node reads the folder of that name in its own working
directory, as two volunteers' machines would. The folders hold different files: the first node that
reads the data sets the swarm's corpus fingerprint, and the second (which reads it too, as the last
stage) exits with one line that says what differs and what to do.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.support.cli import CLI
from tests.support.swarm import Swarm, TINY


def _write_corpus(folder: Path, seed: int) -> None:
    folder.mkdir(parents=True)
    for k in range(4):
        (folder / f"doc{k}.txt").write_text(f"document {k} of machine {seed}\n" * (200 + 50 * seed))


def test_a_node_with_other_training_data_is_refused_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=4, codec="none", layers=2, stages=2).replace("[data]\n", '[data]\npath = "corpus"\n'))
    for k in (0, 1):
        _write_corpus(tmp_path / f"machine{k}" / "corpus", k)
    s = Swarm(tmp_path, config)
    try:
        addr = s.start_coordinator()
        first = subprocess.Popen(
            [*CLI, "node", "join", "--coordinator", addr, "--data-dir", str(tmp_path / "n0"), "--device", "cpu", "--threads", "1"],
            cwd=tmp_path / "machine0", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        s.procs["n0"] = first
        deadline = time.monotonic() + 90
        while not list((tmp_path / "n0").glob("node.jsonl")) or '"built"' not in (tmp_path / "n0" / "node.jsonl").read_text():
            assert time.monotonic() < deadline and first.poll() is None, "the first node did not build its stage"
            time.sleep(0.2)
        second = subprocess.run(
            [*CLI, "node", "join", "--coordinator", addr, "--data-dir", str(tmp_path / "n1"), "--device", "cpu", "--threads", "1"],
            cwd=tmp_path / "machine1", capture_output=True, text=True, timeout=120, check=False,
        )
    finally:
        s.stop()
    assert second.returncode != 0
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "differs from the swarm's" in errors[0] and "data.path" in errors[0], second.stderr
    assert "Traceback" not in second.stderr
