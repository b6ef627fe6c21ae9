"""`protolearn train-local` as a user runs it: a subprocess on the built-in demo run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROTOLEARN = Path(sys.executable).with_name("protolearn")


def test_train_local_demo_lowers_the_loss(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    out = subprocess.run(
        [str(PROTOLEARN), "train-local", "--steps", "20", "--json", "--log", str(log), "--eval-every", "100", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 20
    assert summary["final_val_loss"] < 0.7 * summary["initial_val_loss"]
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0

    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(20))
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert events[0]["run_hash"] == summary["run_hash"]


def test_train_local_default_log_path(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"{i}.txt").write_text("hello protolearn\n" * 200)
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'name = "small"\nsteps = 3\n[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nd_ff = 48\n'
        "[batch]\nmicrobatch_size = 2\nseq_len = 32\n[optim]\nwarmup_steps = 1\n"
    )
    out = subprocess.run(
        [str(PROTOLEARN), "train-local", "--config", str(cfg), "--data", str(data), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "small: 3 steps" in out.stdout
    log = tmp_path / "runs" / "train-local-small.jsonl"
    assert sum(json.loads(line)["event"] == "step" for line in log.read_text().splitlines()) == 3
