"""`python scripts/bench.py`: the one benchmark entry point, and its `reference` suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_suite_is_one_line_listing_the_suites() -> None:
    out = subprocess.run([sys.executable, "scripts/bench.py", "nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "unknown bench suite 'nope'" in out.stderr and "reference" in out.stderr


def test_reference_suite_prints_tokens_per_s(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"{i}.txt").write_text("bench text\n" * 100)
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'name = "b"\n[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nd_ff = 48\n'
        f'[batch]\nmicrobatch_size = 2\nseq_len = 32\n[data]\npath = {json.dumps(str(data))}\n'
    )
    argv = [sys.executable, "scripts/bench.py", "reference", "--json", "--config", str(cfg), "--steps", "2", "--warmup", "1", "--threads", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["suite"] == "reference" and result["steps"] == 2
    assert result["tokens_per_s"] > 0 and result["tokens_per_step"] == 4 * 2 * 32


def test_hivemind_suite_help_and_bad_args_need_no_hivemind() -> None:
    # The suite installs hivemind into its own venv when run; --help and argument errors must not.
    out = subprocess.run([sys.executable, "scripts/bench.py", "hivemind", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "--timeouts" in out.stdout and "--kill-index" in out.stdout
    bad = subprocess.run([sys.executable, "scripts/bench.py", "hivemind", "--kill-index", "4"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "--kill-index=4 must name one of the 4 peers" in bad.stderr


def test_compression_suite_reports_ratio_and_loss_gap_per_codec() -> None:
    # Two 2-step runs of the demo model (the fp32 baseline and subspace k=7): the numbers are not the
    # point here, the report is. The full grid and its results are in docs/BENCHMARKS.md, "Boundary compression against loss".
    argv = [sys.executable, "scripts/bench.py", "compression", "--json", "--models", "demo", "--steps", "2", "--seeds", "0",
            "--workers", "1", "--only", "subspace:fp16 k=7"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    demo = result["models"]["demo"]
    rows = {r["label"]: r for r in demo["codecs"]}
    assert set(rows) == {"none", "subspace:fp16 k=7"}
    # fp32: 1024 bytes per token each way; subspace: 7 fp16 coefficients each way plus a 2-byte token id.
    assert demo["bytes_per_token_none"] == 2048 and rows["subspace:fp16 k=7"]["bytes_per_token"] == 7 * 2 * 2 + 2
    assert result["ratio"] == demo["ratio"] == 2048 / 30 and demo["headline"] == "subspace:fp16 k=7"
    assert result["loss_rel_diff"] == (result["loss_subspace"] - result["loss_none"]) / result["loss_none"]
    assert set(result["goal_met"]) == {"demo"}
