"""`protolearn train-local` as a user runs it: a subprocess on the built-in demo run, and on a tiny
run continued from an exported model (`--init`)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from protolearn.node.checkpoint import save_checkpoint
from protolearn.stages.config import load_run_config
from protolearn.stages.optim import lr_at
from protolearn.stages.reference import ReferenceTrainer
from tests.support.cli import PROTOLEARN



def test_train_local_demo_lowers_the_loss(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    out = subprocess.run(
        [str(PROTOLEARN), "train-local", "--steps", "10", "--json", "--log", str(log), "--eval-every", "100", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 10
    assert summary["final_val_loss"] < 0.7 * summary["initial_val_loss"]
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0

    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(10))
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


def _tiny_run(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    for i in range(6):
        (data / f"{i}.txt").write_text("".join(f"row {j} of {i}: lazy dogs {j * i % 89}\n" for j in range(100)))
    cfg = root / "run.toml"
    cfg.write_text(
        'name = "tiny"\nsteps = 6\n[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nd_ff = 48\nmax_seq_len = 32\n'
        "[batch]\nmicrobatches_per_step = 2\nmicrobatch_size = 2\nseq_len = 32\n[optim]\nwarmup_steps = 1\n"
        f"[data]\npath = {json.dumps(str(data))}\nval_batches = 3\n"
    )
    return cfg


def test_train_local_init_continues_an_exported_model(tmp_path: Path) -> None:
    run = load_run_config(_tiny_run(tmp_path))
    trainer = ReferenceTrainer(run)
    trainer.train(2, eval_every=100)
    for s, (m, o) in enumerate(zip(trainer.stages, trainer.optimizers, strict=True)):
        save_checkpoint(tmp_path / "ckpt", run, s, trainer.step, m, o)
    model = tmp_path / "model.safetensors"
    exp = subprocess.run([str(PROTOLEARN), "export", "--checkpoints", str(tmp_path / "ckpt"), "--out", str(model)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert exp.returncode == 0, exp.stderr
    ev = subprocess.run([str(PROTOLEARN), "evaluate", "--model", str(model), "--json", "--threads", "1"],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    val_loss = json.loads(ev.stdout)["val_loss"]

    # No --config: the run comes from the model file.
    log = tmp_path / "cont.jsonl"
    out = subprocess.run(
        [str(PROTOLEARN), "train-local", "--init", str(model), "--steps", "1", "--json", "--log", str(log), "--threads", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert math.isclose(summary["initial_val_loss"], val_loss, rel_tol=1e-6)
    assert summary["run_hash"] == run.run_hash()
    assert (summary["start_step"], summary["end_step"], summary["steps"]) == (2, 3, 1)
    # It trained step 2 of the schedule (its data and learning rate), not step 0 again.
    (first,) = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]
    assert first["step"] == 2 and math.isclose(first["lr"], lr_at(2, run.optim), rel_tol=1e-9)

    # Without --steps it trains to the end of the run (6 steps) and no further.
    rest = subprocess.run([str(PROTOLEARN), "train-local", "--init", str(model), "--log", str(log), "--threads", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr
    assert f"tiny: 4 steps (steps 2-5, from {model})" in rest.stdout
    assert json.loads(log.read_text().splitlines()[-1])["end_step"] == run.steps


def test_train_local_init_fails_with_one_line(tmp_path: Path) -> None:
    missing = subprocess.run([str(PROTOLEARN), "train-local", "--init", str(tmp_path / "nope.safetensors")],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.strip().count("\n") == 0 and "file not found" in missing.stderr
