"""The exported whole model: every stage's state of one step assembled into one safetensors file.

:func:`export_model` assembles it from a folder of stage checkpoints; :func:`write_model` writes it
from parameter tensors (``protolearn swarm export`` fetches them from live replicas).

An exported model is one safetensors file of every parameter under its global name (loadable with
``Transformer.load_state_dict``), with the run TOML, run hash and step as metadata, plus the run
config beside it as ``<name>.toml``. It carries no optimizer state. Never torch.load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as st_save
from torch import Tensor

from protolearn.node.checkpoint import (
    CheckpointError,
    Spec,
    SafetensorsHeader,
    int_meta,
    read_header,
    read_tensors,
    write_atomic,
    checkpoint_name,
    list_checkpoints,
    load_checkpoint,
    state_digest,
)
from protolearn.stages.config import RunConfig
from protolearn.stages.optim import make_optimizer
from protolearn.stages.model import Transformer
from protolearn.stages.partition import PartitionPlan
from protolearn.stages.stage import StageModule, build_stage

MODEL_FORMAT = "protolearn-model/1"

@dataclass(frozen=True)
class ModelInfo:
    """The metadata of one exported model file."""

    path: Path
    step: int
    run_hash: str
    run_toml: str
    state_digest: str  # state_digest() of the parameters, checked on load

    def run(self) -> RunConfig:
        """The run config embedded in the file."""
        return RunConfig.from_toml_text(self.run_toml, source=f"run config embedded in '{self.path}'")

@dataclass(frozen=True)
class ExportResult:
    out: Path
    sidecar: Path
    run: RunConfig
    step: int
    num_params: int
    note: str | None  # set when the stages' newest checkpoints disagreed


def sidecar_path(out: Path) -> Path:
    """Where the run config of an exported model goes: ``model.safetensors`` -> ``model.toml``."""
    return out.with_suffix(".toml")


def export_model(checkpoint_dir: str | Path, out: str | Path, run: RunConfig | None = None) -> ExportResult:
    """Assemble the newest step that every stage has in ``checkpoint_dir`` into one model file + its TOML.

    ``run`` None takes the run embedded in the checkpoints (the folder must hold a single run).
    """
    d, out = Path(checkpoint_dir), Path(out)
    if out.suffix == ".toml":
        raise CheckpointError(str(out), "the model file must not end in .toml (its run config goes beside it as <name>.toml)")
    infos = list_checkpoints(d)
    if not infos:
        raise CheckpointError(str(d), "holds no stage checkpoints (stage-<s>-step-<t>.safetensors); point --checkpoints at the folder nodes saved them to")
    if run is None:
        hashes = sorted({i.run_hash for i in infos})
        if len(hashes) > 1:
            raise CheckpointError(str(d), f"holds checkpoints of {len(hashes)} runs ({', '.join(h[:12] for h in hashes)}); pass --config to pick one")
        run = RunConfig.from_toml_text(infos[0].run_toml, source=f"run config embedded in '{infos[0].path}'")
        if run.run_hash() != hashes[0]:
            raise CheckpointError(str(infos[0].path), "its embedded run config does not match its run hash; the file is corrupt")
    else:
        infos = [i for i in infos if i.run_hash == run.run_hash()]
        if not infos:
            raise CheckpointError(str(d), f"holds no checkpoint of run '{run.name}' ({run.run_hash()[:12]}); pass the --config they were trained with")
    num_stages = PartitionPlan.from_config(run).num_stages
    steps = {s: sorted({i.step for i in infos if i.stage == s}) for s in range(num_stages)}
    for s, have in steps.items():
        if not have:
            raise CheckpointError(str(d), f"has no checkpoint of stage {s} of run '{run.name}'; copy one there (stage-{s}-step-<t>.safetensors)")
    common = set.intersection(*(set(v) for v in steps.values()))
    if not common:
        shown = "; ".join(f"stage {s}: {', '.join(map(str, v))}" for s, v in steps.items())
        raise CheckpointError(str(d), f"stages have no step in common ({shown}); copy checkpoints of one step for every stage")
    step = max(common)
    note = None
    if any(v[-1] != step for v in steps.values()):
        shown = ", ".join(f"stage {s}: {v[-1]}" for s, v in steps.items())
        note = f"stages disagree on the latest step ({shown}); exported step {step}, the newest one every stage has"
    params: dict[str, Tensor] = {}
    for s in range(num_stages):  # one stage in memory at a time, besides the assembled parameters
        module = build_stage(run, s)
        # A DiLoCo run's checkpoint also holds the outer momentum (its parameters are the state after an outer sync).
        load_checkpoint(d / checkpoint_name(s, step), run, s, module, make_optimizer(module.parameters(), run.optim),
                        outer={} if run.sync.diloco else None)
        params.update({n: p.detach().to("cpu", copy=True).contiguous() for n, p in module.named_parameters()})
    return write_model(params, run, step, out, note=note)


def write_model(params: Mapping[str, Tensor], run: RunConfig, step: int, out: str | Path, *, note: str | None = None) -> ExportResult:
    """Write every parameter of ``run``'s model (global names) after ``step`` steps as one model file + its TOML.

    The names, dtypes and shapes must be exactly the whole model's (as every stage of ``run`` builds
    them), so a file written here always loads with :func:`load_model`.
    """
    out = Path(out)
    if out.suffix == ".toml":
        raise CheckpointError(str(out), "the model file must not end in .toml (its run config goes beside it as <name>.toml)")
    want = {n: (p.dtype, tuple(p.shape)) for s in range(PartitionPlan.from_config(run).num_stages) for n, p in build_stage(run, s).named_parameters()}
    got = {n: (t.dtype, tuple(t.shape)) for n, t in params.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        raise CheckpointError(str(out), f"the parameters are not run '{run.name}''s model (missing {missing[:3]}, unexpected {extra[:3]}, wrong dtype/shape {wrong[:3]})")
    tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in sorted(params.items())}
    meta = {"format": MODEL_FORMAT, "run_hash": run.run_hash(), "run_toml": run.to_toml(), "step": str(step),
            "state_digest": state_digest(tensors)}
    write_atomic(out, st_save(tensors, metadata=meta))
    write_atomic(sidecar_path(out), run.to_toml().encode())
    return ExportResult(out, sidecar_path(out), run, step, sum(t.numel() for t in tensors.values()), note)


def read_model_info(path: str | Path) -> ModelInfo:
    """The metadata of an exported model file, reading only its header."""
    path = Path(path)
    meta = read_header(path).metadata
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(str(path), f"not a protolearn exported model (format {meta.get('format', 'missing')[:40]!r}, want {MODEL_FORMAT!r})")
    return ModelInfo(path, int_meta(str(path), meta, "step"), meta.get("run_hash", ""), meta.get("run_toml", ""), meta.get("state_digest", ""))


@torch.no_grad()
def load_model(path: str | Path, stages: Sequence[StageModule]) -> ModelInfo:
    """Copy an exported model's parameters into ``stages`` (all stages of one run, e.g. ReferenceTrainer.stages).

    Names, dtypes and shapes must match the stages exactly and values must be finite; the optimizer
    state is not part of an export. On any problem nothing is changed.
    """
    path = Path(path)
    info = read_model_info(path)
    params = {n: p for m in stages for n, p in m.named_parameters()}
    spec: Spec = {f"param/{n}": (p.dtype, tuple(p.shape)) for n, p in params.items()}
    header = read_header(path)
    header = SafetensorsHeader(header.size, header.file_size, header.metadata, {f"param/{n}": v for n, v in header.tensors.items()})
    tensors = read_tensors(path, header, spec)
    if state_digest(tensors) != info.state_digest:
        raise CheckpointError(str(path), "its tensors do not match the digest recorded when it was exported; the file is corrupt")
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(str(path), f"parameter {name!r} holds NaN or Inf")
    for name, p in params.items():
        p.copy_(tensors[name].to(p.device))
    return info


def load_transformer(path: str | Path, device: str = "cpu") -> tuple[Transformer, ModelInfo]:
    """The whole model of an exported file in one :class:`~protolearn.stages.model.Transformer` (for sampling)."""
    info = read_model_info(path)
    run = info.run()
    model = Transformer(run.model, run.seed)
    load_model(path, [model])  # type: ignore[list-item]  # the same global parameter names as the stages'
    return model.to(device).eval(), info
