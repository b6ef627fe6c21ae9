"""The run configuration: model, stage split, batch, optimizer, data and codec, as frozen pydantic models.

A run is fixed by one :class:`RunConfig`. The coordinator ships it to nodes as TOML text
(:meth:`RunConfig.to_toml` / :meth:`RunConfig.from_toml_text`) and every node checks
:meth:`RunConfig.run_hash`, a sha256 over canonical JSON, so the hash is the same in every process.

All validation failures become one :class:`~protolearn.errors.ConfigError` line that names the field
and the bad value. TOML has no null, so every optional field defaults to ``None`` and ``None`` values
are left out of the TOML text; that keeps ``from_toml_text(to_toml())`` an exact round trip.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protolearn.codec_spec import CodecSpec, parse_codec_spec
from protolearn.step_limits import MAX_TICKETS_PER_STEP
from protolearn.errors import ConfigError
from protolearn.precision import PRECISIONS, Precision
from protolearn.sync_spec import SyncCompression, parse_sync_compression

DEMO_RUN = "demo"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ModelConfig(_Frozen):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, causal attention, untied embedding and head."""

    vocab_size: int = Field(259, ge=2)
    d_model: int = Field(256, ge=2)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(8, ge=1)
    d_ff: int = Field(688, ge=1)
    max_seq_len: int = Field(256, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; pick n_heads that divides d_model"
            )
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head size d_model/n_heads={self.d_model // self.n_heads} is odd; RoPE needs an even head size"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class StagesConfig(_Frozen):
    """How many pipeline stages, and optionally how many transformer layers each one holds."""

    num_stages: int = Field(2, ge=1)
    # Layers per stage; None = an even split (the earlier stages take the remainder).
    layers: list[int] | None = None

    @field_validator("layers")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(n < 1 for n in v):
            raise ValueError(f"layers={v} has a stage with fewer than 1 layer; every stage needs at least one")
        return v


class BatchConfig(_Frozen):
    """One optimizer step = ``microbatches_per_step`` microbatches of ``microbatch_size`` x ``seq_len`` tokens."""

    microbatches_per_step: int = Field(4, ge=1, le=MAX_TICKETS_PER_STEP)
    microbatch_size: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=1)
    # What a step does with the tickets whose gradients a replica held when it departed (left, crashed, was banned)
    # before its stage averaged them: "redo" them through every stage (I1 exact: every stage covers all B tickets),
    # or "drop" them from that stage's sum only, the other stages keeping them (a large swarm with churn: redoing
    # them made a step of a 32-stage swarm never close; the coordinator's tickets.py and docs/BENCHMARKS.md).
    departures: Literal["redo", "drop"] = "redo"
    # A "drop" run may close a step once this share of its tickets is done and a grace window of close_grace x the
    # time that took has passed, without the rest (coordinator/core/close_rule.py); 1.0: only with every ticket done.
    close_quorum: float = Field(1.0, gt=0.5, le=1.0)
    close_grace: float = Field(0.25, ge=0.0, le=100.0)

    @model_validator(mode="after")
    def _quorum_drops(self) -> BatchConfig:
        if self.close_quorum < 1.0 and self.departures != "drop":
            raise ValueError(f"close_quorum={self.close_quorum} drops tickets, so it needs departures = \"drop\" (got {self.departures!r})")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches_per_step * self.microbatch_size * self.seq_len


class OptimConfig(_Frozen):
    """AdamW with linear warmup then cosine decay to ``min_lr`` at ``total_steps``; optional per-stage clipping."""

    lr: float = Field(3e-3, gt=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(10, ge=0)
    total_steps: int = Field(200, ge=1)
    min_lr: float = Field(3e-4, ge=0)
    clip_norm: float | None = Field(None, gt=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: list[float]) -> list[float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas={v} must both be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} exceeds lr={self.lr}")
        return self


class DataConfig(_Frozen):
    """Where the text comes from. ``path`` None = the running Python's stdlib ``.py`` files."""

    path: str | None = None
    val_fraction: float = Field(0.1, gt=0, lt=1)
    # Cap on the bytes read, so loading stays fast (the stdlib alone is tens of MB).
    max_bytes: int = Field(4_000_000, ge=1)
    # Number of fixed validation microbatches used by evaluate().
    val_batches: int = Field(8, ge=1)


class IntegrityConfig(_Frozen):
    """Stagewise integrity (DESIGN.md "Integrity"): boundary monitors, spot checks, probation, robust aggregation.

    A newcomer is spot-checked at rate 1.0; the rate halves every ``probation_half_life`` checks it
    passes, down to ``spot_check_rate``. A spot check passes when the recomputed output is within
    ``check_tolerance`` (relative L2) of what was sent, on top of the codec's own error. A
    ``spot_check_rate`` of 0 turns spot checks off altogether, probation included.
    """

    monitors: bool = True
    spot_check_rate: float = Field(0.05, ge=0.0, le=1.0)
    probation_half_life: int = Field(8, ge=1, le=1_000_000)
    check_tolerance: float = Field(1e-3, gt=0.0, le=1.0)
    # The precisions a replica may compute in (protolearn/precision.py): a node declaring another is refused
    # at join, and every comparison of two replicas' outputs allows for the loosest pair of them.
    precisions: tuple[Precision, ...] = Field(("fp32",), min_length=1, max_length=len(PRECISIONS))

    @field_validator("precisions")
    @classmethod
    def _distinct(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"{list(v)} names a precision twice")
        return v
    # A joiner runs its stage on a fixed input from the run seed and compares with its donor's output.
    self_test: bool = True
    # How the replicas of a stage combine their gradients (protocol/collective/robust.py): "mean" (the default), "trimmed_mean"
    # or "centered_clip". The robust rules act on each replica's per-ticket mean, per collective part, and are scaled
    # back to the sum's scale; with fewer than 3 contributors they are the mean.
    aggregation: str = Field("mean", pattern=r"^(mean|trimmed_mean|centered_clip)$")
    # Each part a replica reduces in the collective is recomputed by the next replica in its chain, which
    # vetoes the round with a proof when the reducer signed a wrong part (scatter traffic doubles).
    cross_check: bool = True
    # trimmed_mean: the fraction of replicas cut at each end per coordinate, floor(fraction * k) but at least one
    # when there are 3+ and the fraction is > 0 (3 replicas: the coordinate-wise median); the rest are ticket-weighted.
    trim_fraction: float = Field(0.25, ge=0.0, lt=0.5)
    # centered_clip: start at the coordinate-wise median; the clipping radius is clip_tau times the median replica's
    # distance from it (scale-free); clip_iters fixed iterations (each moves the centre by at most the radius).
    clip_tau: float = Field(1.0, gt=0.0, le=1e6)
    clip_iters: int = Field(3, ge=1, le=100)


class SubspaceConfig(_Frozen):
    """Subspace-constrained residual stream (DESIGN.md "Compression"; :mod:`protolearn.subspace`).

    ``rank`` k (None = off) confines every weight that writes to the residual stream to a fixed
    k-dimensional basis, so the ``subspace`` codec can send k numbers per token across a boundary and
    rebuild the activation exactly. The weights are projected back onto the basis after every
    ``period``-th optimizer step (between projections the activations drift out of the subspace, and
    the codec drops the drift). The last ``tail_blocks`` blocks stay unconstrained; they must all sit
    in the last stage, after the last boundary.
    """

    rank: int | None = Field(None, ge=1)
    period: int = Field(1, ge=1, le=1_000_000)
    tail_blocks: int = Field(0, ge=0)


class SyncConfig(_Frozen):
    """How the replicas of a stage stay in step (DESIGN.md "How one training step flows", step 4; issue 24).

    ``mode = "step"``: every step, the replicas average their gradients with the collective (DESIGN.md's
    one-step flow). ``diloco``: each replica takes its own AdamW inner steps on the tickets that pass
    through it; after every ``inner_steps`` steps the replicas average their pseudo-gradients (parameters
    at the last sync minus now) weighted by the tokens each processed, and apply one Nesterov outer step
    with ``outer_lr`` and ``outer_momentum`` (node/core/outer_round.py). An outer round goes ahead once
    ``quorum`` replicas of the stage (at most as many as are live) are ready and ``grace_s`` passed since
    the first; late or dead replicas are left out and resync (coordinator/core/outer_rounds.py).
    ``max_weight_share`` caps any one replica's share of the weight (Throttle); None: no cap.

    ``compression`` (:mod:`protolearn.sync_spec`; :mod:`protolearn.protocol.sync_compression`) is what the
    average sends, in either mode (a step's gradients, or an outer round's pseudo-gradients): ``none``
    (raw float32: the swarm equals ``train-local``), ``int8``, ``topk:F`` or ``powersgd:R``.
    """

    mode: str = Field("step", pattern=r"^(step|diloco)$")
    compression: str = "none"
    inner_steps: int = Field(32, ge=1, le=1000)
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    quorum: int = Field(1, ge=1, le=1_000_000)
    grace_s: float = Field(2.0, ge=0.0, le=3600.0)
    max_weight_share: float | None = Field(None, gt=0.0, le=1.0)

    @field_validator("compression")
    @classmethod
    def _known_compression(cls, v: str) -> str:
        parse_sync_compression(v, field="sync.compression")
        return v

    @property
    def diloco(self) -> bool:
        return self.mode == "diloco"

    @property
    def compression_spec(self) -> SyncCompression:
        """The parsed :attr:`compression` (already validated, so this cannot fail)."""
        return parse_sync_compression(self.compression)


class RunConfig(_Frozen):
    """Everything that fixes a training run. Every node must hold the same one (see :meth:`run_hash`)."""

    name: str = Field(DEMO_RUN, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    seed: int = Field(0, ge=0, lt=2**63)
    steps: int = Field(200, ge=1)
    codec: str = "none"
    model: ModelConfig = Field(default_factory=ModelConfig)
    stages: StagesConfig = Field(default_factory=StagesConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    integrity: IntegrityConfig = Field(default_factory=IntegrityConfig)
    subspace: SubspaceConfig = Field(default_factory=SubspaceConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        # The one codec grammar, shared with protocol/codecs/; its error names this field.
        parse_codec_spec(v, field="codec")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        s, n = self.stages.num_stages, self.model.n_layers
        if s > n:
            raise ValueError(f"stages.num_stages={s} exceeds model.n_layers={n}; every stage needs at least one layer")
        layers = self.stages.layers
        if layers is not None:
            if len(layers) != s:
                raise ValueError(f"stages.layers={layers} has {len(layers)} entries but stages.num_stages={s}")
            if sum(layers) != n:
                raise ValueError(f"stages.layers={layers} sums to {sum(layers)} but model.n_layers={n}")
        if self.batch.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"batch.seq_len={self.batch.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        self._subspace_consistent()
        return self

    def _subspace_consistent(self) -> None:
        sub, d = self.subspace, self.model.d_model
        if sub.rank is None:
            if self.codec_spec.name == "subspace":
                raise ValueError(
                    f"field 'codec': codec={self.codec!r} needs a subspace-constrained model; set subspace.rank "
                    f"(e.g. [subspace] rank = {max(1, d // 32)}) or pick another codec"
                )
            return
        if sub.rank >= d:
            raise ValueError(f"field 'subspace.rank': rank={sub.rank} must be below model.d_model={d}")
        # The last stage's layer count (stages/partition.py's even split gives the remainder to the earliest stages).
        last = self.stages.layers[-1] if self.stages.layers else self.model.n_layers // self.stages.num_stages
        if sub.tail_blocks > last:
            raise ValueError(
                f"field 'subspace.tail_blocks': tail_blocks={sub.tail_blocks} exceeds the {last} block(s) of the last stage; "
                "an unconstrained block before a stage boundary would make that boundary's activations uncompressible"
            )

    @property
    def codec_spec(self) -> CodecSpec:
        """The parsed :attr:`codec` (already validated, so this cannot fail)."""
        return parse_codec_spec(self.codec, field="codec")

    @property
    def subspace_key(self) -> tuple[int, int, int, int, float] | None:
        """The arguments of :func:`protolearn.subspace.make_subspace` for this run, None without a subspace."""
        if self.subspace.rank is None:
            return None
        return (self.seed, self.model.vocab_size, self.model.d_model, self.subspace.rank, self.model.init_std)

    def run_hash(self) -> str:
        """sha256 hex of the canonical JSON form; equal configs hash equally in every process."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_toml(self) -> str:
        """TOML text that :meth:`from_toml_text` turns back into an equal config."""
        return _to_toml(self.model_dump(mode="json"))

    @classmethod
    def from_toml_text(cls, text: str, *, source: str = "run config") -> RunConfig:
        """Parse and validate TOML text; any problem is one ConfigError line naming ``source``."""
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{source}: TOML syntax error: {err}; fix the file") from None
        return validate_run(raw, source=source)

    def replace(self, **updates: Any) -> RunConfig:
        """A validated copy with dotted-path updates, e.g. ``replace(**{"data.path": "corpus/"})``."""
        raw = self.model_dump(mode="json")
        for dotted, value in updates.items():
            *parents, leaf = dotted.split(".")
            target = raw
            for key in parents:
                if not isinstance(target.get(key), dict):
                    raise ConfigError(f"run config override: unknown section '{key}' in '{dotted}'")
                target = target[key]
            target[leaf] = value
        return validate_run(raw, source="run config override")


def validate_run(raw: dict[str, Any], *, source: str = "run config") -> RunConfig:
    """Validate a plain dict as a RunConfig, turning the first pydantic error into one ConfigError line."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_one_line(err)}") from None


def _one_line(err: ValidationError) -> str:
    first = err.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind, msg = first["type"], first["msg"]
    if kind == "extra_forbidden":
        return f"unknown field '{field}'; remove it or check its spelling"
    if kind in ("value_error", "assertion_error"):
        msg = msg.removeprefix("Value error, ")
        return msg if not first["loc"] else f"field '{field}': {msg}"
    shown = first.get("input")
    shown_text = "(missing)" if kind == "missing" else repr(shown)
    if len(shown_text) > 60:
        shown_text = shown_text[:57] + "..."
    return f"field '{field}' = {shown_text}: {msg}"


def load_run_config(path: str | Path | None) -> RunConfig:
    """Read a run config TOML file; ``None`` gives the built-in demo run."""
    if path is None:
        return default_run()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"run config file '{p}' not found; pass an existing file or omit --config for the demo run") from None
    except IsADirectoryError:
        raise ConfigError(f"run config '{p}' is a directory; pass a .toml file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read run config '{p}': {err}") from None
    return RunConfig.from_toml_text(text, source=str(p))


_DEMO_CACHE: list[RunConfig] = []


def default_run() -> RunConfig:
    """The built-in ``demo`` run, shipped as package data ``stages/runs/demo.toml``."""
    if not _DEMO_CACHE:
        text = resources.files("protolearn.stages").joinpath("runs", f"{DEMO_RUN}.toml").read_text(encoding="utf-8")
        _DEMO_CACHE.append(RunConfig.from_toml_text(text, source="built-in demo run"))
    return _DEMO_CACHE[0]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write non-finite number {v} to TOML")
        return repr(v)
    if isinstance(v, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {type(v).__name__} value to TOML")


def _to_toml(raw: dict[str, Any]) -> str:
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in raw.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
