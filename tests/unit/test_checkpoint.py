"""Stage state round trips, atomic checkpoints, hostile or broken files, and the exported model."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protolearn.node.checkpoint import (
    CheckpointError,
    StageStateError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_stage_state,
    read_checkpoint_info,
    save_checkpoint,
    shared_leaves,
    shared_state_hash,
    stage_state,
)
from protolearn.node.export import export_model, load_model, read_model_info
from protolearn.stages.config import RunConfig, validate_run
from protolearn.stages.model import Transformer
from protolearn.stages.optim import apply_step, make_optimizer
from protolearn.stages.reference import ReferenceTrainer
from protolearn.stages.stage import StageModule, build_stage, state_root

RAW = {
    "name": "tiny",
    "model": {"d_model": 32, "n_layers": 3, "n_heads": 4, "d_ff": 48, "max_seq_len": 32},
    "stages": {"num_stages": 2},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16},
    "optim": {"warmup_steps": 1, "clip_norm": 1.0},
}


@pytest.fixture(scope="module")
def run() -> RunConfig:
    return validate_run(RAW)


class Pipe:
    """The run's stages with their optimizers, trained on seeded random tokens (no corpus needed)."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.stages = [build_stage(run, s) for s in range(2)]
        self.optims = [make_optimizer(m.parameters(), run.optim) for m in self.stages]
        self.step = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(1000 + self.step)
            tokens = torch.randint(0, self.run.model.vocab_size, (2, 17), generator=g)
            h = self.stages[0](0, tokens[:, :-1])
            self.stages[1](0, h, tokens[:, 1:])
            self.stages[0].backward(0, self.stages[1].backward(0, None))
            for m, o in zip(self.stages, self.optims):
                apply_step(m, o, self.step, self.run.optim)
            self.step += 1


def fresh(run: RunConfig, stage: int) -> tuple[StageModule, torch.optim.Optimizer]:
    m = build_stage(run, stage)
    return m, make_optimizer(m.parameters(), run.optim)


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(run: RunConfig) -> Pipe:
    pipe = Pipe(run)
    pipe.train(2)
    return pipe


def test_stage_state_round_trip_is_bit_identical_and_the_next_step_matches(run: RunConfig) -> None:
    src = Pipe(run)
    src.train(2)
    dst = Pipe(run)
    for s in range(2):
        state = stage_state(src.stages[s], src.optims[s])
        assert {k.partition("/")[0] for k in state} == {"param", "step", "exp_avg", "exp_avg_sq"}
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
        load_stage_state(dst.stages[s], dst.optims[s], state, peer_or_path="peer-A")
        assert dst.stages[s].state_hash() == src.stages[s].state_hash()
        assert same_state(stage_state(dst.stages[s], dst.optims[s]), state)
    dst.step = src.step
    src.train(1)
    dst.train(1)
    assert [m.state_hash() for m in dst.stages] == [m.state_hash() for m in src.stages]


def test_state_before_the_first_step_has_no_optimizer_entries(run: RunConfig) -> None:
    m, o = fresh(run, 1)
    state = stage_state(m, o)
    assert all(k.startswith("param/") for k in state)
    other, other_o = fresh(run, 1)
    load_stage_state(other, other_o, state, peer_or_path="x")
    assert other.state_hash() == m.state_hash() and not other_o.state


MUTATIONS = [("drop-param", "lacks parameter"), ("extra", "unexpected tensor"), ("shape", "needs float32"),
             ("dtype", "is float16"), ("drop-moment", "optimizer state is incomplete"), ("nan", "NaN or Inf"),
             ("fractional-step", "whole number"), ("mixed-steps", "steps differ")]


@pytest.mark.parametrize("kind,reason", MUTATIONS)
def test_load_stage_state_rejects_a_state_that_does_not_fit_and_changes_nothing(trained: Pipe, kind: str, reason: str) -> None:
    state = dict(stage_state(trained.stages[0], trained.optims[0]))
    name = "blocks.0.attn.wq.weight"
    if kind == "drop-param":
        del state[f"param/{name}"]
    elif kind == "extra":
        state["param/blocks.9.attn.wq.weight"] = state[f"param/{name}"]
    elif kind == "shape":
        state[f"param/{name}"] = state[f"param/{name}"][:-1]
    elif kind == "dtype":
        state[f"exp_avg/{name}"] = state[f"exp_avg/{name}"].half()
    elif kind == "drop-moment":
        del state[f"exp_avg_sq/{name}"]
    elif kind == "nan":
        state[f"param/{name}"] = state[f"param/{name}"].clone()
        state[f"param/{name}"][0, 0] = float("nan")
    elif kind == "fractional-step":
        state = {k: (torch.tensor(1.5) if k.startswith("step/") else v) for k, v in state.items()}
    elif kind == "mixed-steps":
        state[f"step/{name}"] = torch.tensor(7.0)
    m, o = fresh(trained.run, 0)
    before = m.state_hash()
    with pytest.raises(StageStateError) as err:
        load_stage_state(m, o, state, peer_or_path="peer-Q")
    assert str(err.value).startswith("peer-Q: ") and reason in str(err.value) and "\n" not in str(err.value)
    assert m.state_hash() == before and not o.state


def test_save_checkpoint_is_named_by_stage_and_step_and_keeps_the_newest_k(tmp_path: Path, run: RunConfig) -> None:
    pipe = Pipe(run)
    for step in range(1, 6):
        pipe.train(1)
        path = save_checkpoint(tmp_path, run, 1, step, pipe.stages[1], pipe.optims[1], keep=3)
        assert path == tmp_path / f"stage-1-step-{step}.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"stage-1-step-{t}.safetensors" for t in (3, 4, 5)]
    info = read_checkpoint_info(path)
    assert (info.stage, info.step, info.num_stages, info.run_hash) == (1, 5, 2, run.run_hash())
    # The checkpoint is named by the hash its replicas report: parameters and AdamW's state, not the parameters alone.
    assert info.state_hash == shared_state_hash(pipe.stages[1], pipe.optims[1]) != pipe.stages[1].state_hash()
    assert RunConfig.from_toml_text(info.run_toml) == run
    m, o = fresh(run, 1)
    assert load_checkpoint(path, run, 1, m, o) == 5
    assert same_state(stage_state(m, o), stage_state(pipe.stages[1], pipe.optims[1]))
    assert shared_state_hash(m, o) == info.state_hash
    # The hash is a hash of its tensors' digests: what a donor announces before sending them (node/state_sync.py).
    leaves = shared_leaves(list(stage_state(m, o).items()), diloco=False)
    assert state_root(leaves) == info.state_hash and len(leaves) == 4 * len(m.param_names())
    # A fresh stage (no optimizer state yet) hashes as its parameters alone.
    assert shared_state_hash(*fresh(run, 1)) == fresh(run, 1)[0].state_hash()


def test_latest_checkpoint_ignores_leftover_temp_files_and_other_names(tmp_path: Path, trained: Pipe) -> None:
    run = trained.run
    save_checkpoint(tmp_path, run, 0, 2, trained.stages[0], trained.optims[0])
    save_checkpoint(tmp_path, run, 1, 1, trained.stages[1], trained.optims[1])
    (tmp_path / ".stage-0-step-9.safetensors.123-abcd.tmp").write_bytes(b"half a file")
    (tmp_path / "stage-0-step-7.safetensors.bak").write_bytes(b"x")
    (tmp_path / "stage-0-step-8.safetensors").write_bytes(b"\x00" * 3)  # a torn file under a real name
    assert [(i.stage, i.step) for i in list_checkpoints(tmp_path)] == [(0, 2), (1, 1)]
    assert latest_checkpoint(tmp_path, stage=0).step == 2
    assert latest_checkpoint(tmp_path, stage=1).step == 1
    assert latest_checkpoint(tmp_path).stage == 0
    assert latest_checkpoint(tmp_path, stage=5) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def _damage(path: Path, kind: str) -> None:
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    if kind == "truncated":
        path.write_bytes(blob[: len(blob) - 100])
    elif kind == "torn-header":
        path.write_bytes(blob[: 8 + size // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(b"not a checkpoint at all, just text\n" * 10)
    elif kind == "huge-header":
        path.write_bytes(struct.pack("<Q", 2**62) + blob[8:])
    elif kind == "bit-flip":
        flipped = bytearray(blob)
        flipped[8 + size + 5] ^= 0x40  # inside the first tensor's data
        path.write_bytes(bytes(flipped))


@pytest.mark.parametrize("kind", ["truncated", "torn-header", "empty", "garbage", "huge-header", "bit-flip"])
def test_a_broken_checkpoint_is_a_one_line_error_and_loads_nothing(tmp_path: Path, trained: Pipe, kind: str) -> None:
    run = trained.run
    path = save_checkpoint(tmp_path, run, 1, 2, trained.stages[1], trained.optims[1])
    _damage(path, kind)
    m, o = fresh(run, 1)
    before = m.state_hash()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, run, 1, m, o)
    msg = str(err.value)
    assert msg.startswith(str(path)) and "\n" not in msg
    assert m.state_hash() == before and not o.state


def test_a_checkpoint_of_another_run_or_stage_is_refused(tmp_path: Path, trained: Pipe) -> None:
    run = trained.run
    path = save_checkpoint(tmp_path, run, 0, 2, trained.stages[0], trained.optims[0])
    other = run.replace(seed=1)
    m, o = fresh(other, 0)
    with pytest.raises(CheckpointError, match="belongs to run .* not this run"):
        load_checkpoint(path, other, 0, m, o)
    m, o = fresh(run, 1)
    with pytest.raises(CheckpointError, match="holds stage 0, not stage 1"):
        load_checkpoint(path, run, 1, m, o)
    save_file({"x": torch.zeros(2)}, str(tmp_path / "stage-0-step-3.safetensors"), metadata={"format": "other"})
    with pytest.raises(CheckpointError, match="not a protolearn stage checkpoint"):
        read_checkpoint_info(tmp_path / "stage-0-step-3.safetensors")


def test_export_assembles_the_whole_model_under_transformer_names(tmp_path: Path, trained: Pipe) -> None:
    run, ckpt = trained.run, tmp_path / "ckpt"
    for s in range(2):
        save_checkpoint(ckpt, run, s, 2, trained.stages[s], trained.optims[s])
    result = export_model(ckpt, tmp_path / "model.safetensors")
    assert (result.step, result.note, result.run) == (2, None, run)
    assert result.sidecar == tmp_path / "model.toml"
    assert RunConfig.from_toml_text(result.sidecar.read_text()) == run
    whole = Transformer(run.model, run.seed)
    whole.load_state_dict(load_file(str(result.out)))  # strict: exactly the whole model's names and shapes
    mine = {n: p for m in trained.stages for n, p in m.named_parameters()}
    assert all(torch.equal(p, mine[n]) for n, p in whole.named_parameters())
    assert read_model_info(result.out).step == 2 and read_model_info(result.out).run() == run

    fresh_stages = [build_stage(run, s) for s in range(2)]
    info = load_model(result.out, fresh_stages)
    assert info.run_hash == run.run_hash()
    assert [m.state_hash() for m in fresh_stages] == [m.state_hash() for m in trained.stages]


def test_export_uses_the_newest_step_every_stage_has_and_names_a_missing_stage(tmp_path: Path, run: RunConfig) -> None:
    pipe = Pipe(run)
    pipe.train(1)
    save_checkpoint(tmp_path, run, 0, 1, pipe.stages[0], pipe.optims[0])
    with pytest.raises(CheckpointError, match="no checkpoint of stage 1"):
        export_model(tmp_path, tmp_path / "m.safetensors")
    save_checkpoint(tmp_path, run, 1, 1, pipe.stages[1], pipe.optims[1])
    at_one = [m.state_hash() for m in pipe.stages]
    pipe.train(1)
    save_checkpoint(tmp_path, run, 0, 2, pipe.stages[0], pipe.optims[0])
    result = export_model(tmp_path, tmp_path / "m.safetensors")
    assert result.step == 1 and "stage 0: 2, stage 1: 1" in result.note
    stages = [build_stage(run, s) for s in range(2)]
    load_model(result.out, stages)
    assert [m.state_hash() for m in stages] == at_one
    with pytest.raises(CheckpointError, match="no checkpoint of run"):
        export_model(tmp_path, tmp_path / "m2.safetensors", run.replace(seed=5))


def test_load_model_refuses_a_model_of_another_shape_and_changes_nothing(tmp_path: Path, trained: Pipe) -> None:
    run, ckpt = trained.run, tmp_path / "ckpt"
    for s in range(2):
        save_checkpoint(ckpt, run, s, 2, trained.stages[s], trained.optims[s])
    out = export_model(ckpt, tmp_path / "model.safetensors").out
    wider = run.replace(**{"model.d_ff": 64})
    stages = [build_stage(wider, s) for s in range(2)]
    before = [m.state_hash() for m in stages]
    with pytest.raises(CheckpointError, match="this stage needs float32"):
        load_model(out, stages)
    assert [m.state_hash() for m in stages] == before
    only_first = [build_stage(run, 0)]
    with pytest.raises(CheckpointError, match="unexpected tensor 'param/blocks.2"):
        load_model(out, only_first)
    with pytest.raises(CheckpointError, match="not a protolearn exported model"):
        load_model(ckpt / "stage-0-step-2.safetensors", stages)


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    data = tmp_path_factory.mktemp("data")
    for i in range(6):
        (data / f"{i}.txt").write_text("".join(f"{i}: row {j} says {j * j % 101}\n" for j in range(80)))
    return validate_run({**RAW, "data": {"path": str(data), "val_batches": 2}})


def test_an_exported_model_initialises_the_reference_trainer_with_the_same_val_loss(tmp_path: Path, corpus_run: RunConfig) -> None:
    """What `train-local --init model.safetensors` does: load_model into ReferenceTrainer.stages."""
    src = ReferenceTrainer(corpus_run)
    src.train(2, eval_every=100)
    for s, (m, o) in enumerate(zip(src.stages, src.optimizers)):
        save_checkpoint(tmp_path, corpus_run, s, src.step, m, o)
    out = export_model(tmp_path, tmp_path / "model.safetensors").out
    dst = ReferenceTrainer(corpus_run)
    assert dst.evaluate() != src.evaluate()
    assert load_model(out, dst.stages).step == 2
    assert dst.evaluate() == src.evaluate()


def test_the_reference_trainer_resumed_from_stage_checkpoints_continues_bit_identically(tmp_path: Path, corpus_run: RunConfig) -> None:
    src = ReferenceTrainer(corpus_run)
    src.train(2, eval_every=100)
    for s, (m, o) in enumerate(zip(src.stages, src.optimizers)):
        save_checkpoint(tmp_path, corpus_run, s, src.step, m, o)
    src.train_step()
    resumed = ReferenceTrainer(corpus_run)
    steps = {load_checkpoint(latest_checkpoint(tmp_path, s).path, corpus_run, s, m, o)
             for s, (m, o) in enumerate(zip(resumed.stages, resumed.optimizers))}
    assert steps == {2}
    resumed.step = 2
    resumed.train_step()
    assert resumed.stage_hashes() == src.stage_hashes()
