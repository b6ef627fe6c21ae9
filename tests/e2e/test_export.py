"""`protolearn export` and `protolearn evaluate` as a user runs them, on checkpoints of a reference run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from protolearn.node.checkpoint import save_checkpoint
from protolearn.stages.config import load_run_config
from protolearn.stages.reference import ReferenceTrainer
from tests.support.cli import cli



@pytest.fixture(scope="module")
def swarm_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """Checkpoints of a 2-stage run: both stages at step 2, stage 0 also at step 3; and the val loss at step 2."""
    root = tmp_path_factory.mktemp("export")
    data = root / "data"
    data.mkdir()
    for i in range(8):
        (data / f"{i}.txt").write_text("".join(f"line {j} of file {i}: the quick brown fox {j * i % 97}\n" for j in range(120)))
    cfg = root / "run.toml"
    cfg.write_text(
        f'name = "small"\nsteps = 3\n[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nd_ff = 48\nmax_seq_len = 32\n'
        f'[batch]\nmicrobatches_per_step = 2\nmicrobatch_size = 2\nseq_len = 32\n[optim]\nwarmup_steps = 1\n'
        f"[data]\npath = {json.dumps(str(data))}\nval_batches = 4\n"
    )
    run = load_run_config(cfg)
    trainer = ReferenceTrainer(run)
    ckpt = root / "ckpt"
    trainer.train(2, eval_every=100)
    for s, (m, o) in enumerate(zip(trainer.stages, trainer.optimizers)):
        save_checkpoint(ckpt, run, s, trainer.step, m, o)
    val_at_2 = trainer.evaluate()
    trainer.train_step()
    save_checkpoint(ckpt, run, 0, trainer.step, trainer.stages[0], trainer.optimizers[0])
    return root, val_at_2


def test_export_then_evaluate_reports_the_reference_validation_loss(swarm_dir: tuple[Path, float]) -> None:
    root, val_at_2 = swarm_dir
    out = cli("export", "--checkpoints", str(root / "ckpt"), "--out", str(root / "model.safetensors"), cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("small: exported step 2 ")
    assert "stages disagree on the latest step (stage 0: 3, stage 1: 2); exported step 2" in out.stderr
    assert (root / "model.toml").read_text() == load_run_config(root / "run.toml").to_toml()

    # The sidecar config is what a user passes on; the model file also carries it (used without --config).
    ev = cli("evaluate", "--model", str(root / "model.safetensors"), "--config", str(root / "model.toml"), "--json", cwd=root)
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["step"] == 2 and result["run_hash"] == load_run_config(root / "run.toml").run_hash()
    assert "note:" not in ev.stderr
    assert math.isclose(result["val_loss"], val_at_2, rel_tol=1e-6)


def test_export_and_evaluate_fail_with_one_line(swarm_dir: tuple[Path, float], tmp_path: Path) -> None:
    root, _ = swarm_dir
    only_first = tmp_path / "only-first"
    only_first.mkdir()
    shutil.copy(root / "ckpt" / "stage-0-step-2.safetensors", only_first)
    out = cli("export", "--checkpoints", str(only_first), "--out", str(tmp_path / "m.safetensors"), cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "no checkpoint of stage 1" in out.stderr
    assert not (tmp_path / "m.safetensors").exists()

    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    ev = cli("evaluate", "--model", str(tmp_path / "junk.safetensors"), cwd=tmp_path)
    assert ev.returncode == 1
    assert ev.stderr.strip().count("\n") == 0 and "not valid JSON" in ev.stderr and "Traceback" not in ev.stderr


def test_generate_from_checkpoints_prints_the_prompt_and_its_continuation(swarm_dir: tuple[Path, float], tmp_path: Path) -> None:
    root, _ = swarm_dir
    out = cli("generate", "--checkpoints", str(root / "ckpt"), "--prompt", "def ", "--tokens", "40", "--seed", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def ") and len(out.stdout.rstrip("\n")) > len("def ")
    assert "assembled from" in out.stderr and "Traceback" not in out.stderr
    again = cli("generate", "--checkpoints", str(root / "ckpt"), "--prompt", "def ", "--tokens", "40", "--seed", "3", cwd=tmp_path)
    assert again.stdout == out.stdout  # the seed repeats the sample
    greedy = cli("generate", "--checkpoints", str(root / "ckpt"), "--prompt", "line ", "--tokens", "20", "--temperature", "0", cwd=tmp_path)
    assert greedy.returncode == 0 and greedy.stdout.startswith("line "), greedy.stderr
    # Exactly one source of the model, said in one line.
    both = cli("generate", "--checkpoints", str(root / "ckpt"), "--model", str(root / "x.safetensors"), cwd=tmp_path)
    assert both.returncode == 1 and both.stderr.strip().count("\n") == 0 and "exactly one of" in both.stderr


def test_export_writes_a_hugging_face_llama_folder(swarm_dir: tuple[Path, float], tmp_path: Path) -> None:
    root, _ = swarm_dir
    out = cli("export", "--checkpoints", str(root / "ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["format"] == "hf" and summary["step"] == 2
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0
