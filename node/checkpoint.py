"""Stage state and stage checkpoints on disk, as safetensors.

A stage's state is a flat dict of named CPU tensors: ``param/<name>`` for each parameter and, once
the optimizer has stepped, ``step/<name>``, ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` for its AdamW
state; in DiLoCo mode (``[sync] mode = "diloco"``) also ``outer_m/<name>``, the outer Nesterov momentum, and
``param/<name>`` is then the stage's state after the last outer sync (``stages/outer.py``). ``<name>`` is the global parameter name (``embed.weight``, ``blocks.3.attn.wq.weight``,
``head.out.weight``), the same in a stage and in the whole-model ``Transformer``. The same dict is
what a replica hands a joiner, so :func:`load_stage_state` trusts nothing: every name, dtype, shape
and value is checked against the locally built stage before anything is copied.

A checkpoint is ``stage-<s>-step-<t>.safetensors`` (``t`` = optimizer steps applied), written to a
temp file in the same folder, fsynced and renamed, so a crash leaves either the old set or the new
file, never half a file under the real name. Its metadata holds the format version, run hash, run
TOML, stage, step, number of stages, the parameter hash and a digest of every tensor. Files are
parsed by hand up to the tensor table and checked against the stage (and the file size) before the
tensors are read; the digest is checked before anything is installed.

Never torch.load. The exported whole model is in :mod:`protolearn.node.export`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from protolearn.node.errors import NodeError
from protolearn.stages.config import RunConfig
from protolearn.stages.stage import PARAM_PREFIX, StageModule, state_leaves, state_root

STAGE_FORMAT = "protolearn-stage/1"
DEFAULT_KEEP = 3
# A stage's tensor table is a few KB; anything far bigger is not one of our files.
MAX_HEADER_BYTES = 16 * 2**20
# The optimizer state entries AdamW keeps per parameter (the stage state's ``<key>/<name>`` entries); a
# checkpoint or a donor's snapshot with any other is refused.
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")
# DiLoCo's outer momentum per parameter: in a DiLoCo run's state, for every parameter or none.
OUTER_KEY = "outer_m"
_FILE = re.compile(r"^stage-(\d+)-step-(\d+)\.safetensors$")
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64"}

log = logging.getLogger("protolearn.node")

Spec = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class StageStateError(NodeError):
    """A stage state (a checkpoint file or a peer's snapshot) does not fit the locally built stage."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class CheckpointError(StageStateError):
    """A checkpoint or exported model file is unreadable, malformed, or of another run or stage."""


@dataclass(frozen=True)
class CheckpointInfo:
    """The metadata of one stage checkpoint (read without loading its tensors)."""

    path: Path
    stage: int
    step: int
    num_stages: int
    run_hash: str
    state_hash: str  # shared_state_hash() of the saved state
    state_digest: str  # state_digest() of every saved tensor, checked on load
    run_toml: str


# -- stage state (shared with state sync over the network) ------------------------------------


def state_spec(module: torch.nn.Module, *, outer: bool = False) -> Spec:
    """Every name a state of ``module`` may hold, with the dtype and shape it must have (``outer``: a DiLoCo
    run's, with the outer momentum)."""
    spec: Spec = {}
    for name, p in module.named_parameters():
        shape = tuple(p.shape)
        spec[f"param/{name}"] = (p.dtype, shape)
        spec[f"step/{name}"] = (torch.float32, ())
        spec[f"exp_avg/{name}"] = (p.dtype, shape)
        spec[f"exp_avg_sq/{name}"] = (p.dtype, shape)
        if outer:
            spec[f"{OUTER_KEY}/{name}"] = (torch.float32, shape)
    return spec


def _params(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.nn.Parameter]:
    params = dict(module.named_parameters())
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(p) not in owned for p in params.values()):
        raise ValueError("the optimizer does not hold every parameter of the module; pass the stage's own optimizer")
    return params


@torch.no_grad()
def stage_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, outer_momentum: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Parameters and AdamW state of ``module`` as named contiguous CPU copies (safe to keep or send), with
    DiLoCo's ``outer_momentum`` (parameter name → tensor) when given."""
    out: dict[str, Tensor] = {}
    for name, t in (outer_momentum or {}).items():
        out[f"{OUTER_KEY}/{name}"] = t.detach().to("cpu", torch.float32, copy=True).contiguous()
    params = _params(module, optimizer)
    for name in sorted(params):
        out[f"param/{name}"] = params[name].detach().to("cpu", copy=True).contiguous()
    for name in sorted(params):
        st = optimizer.state.get(params[name], {})
        unknown = set(st) - set(OPTIM_KEYS)
        if unknown:
            raise ValueError(f"optimizer state of {name} has unsupported entries {sorted(unknown)}; only AdamW is supported")
        for key in OPTIM_KEYS:
            if key in st:
                out[f"{key}/{name}"] = st[key].detach().to("cpu", copy=True).contiguous()
    return out


class Snapshot(NamedTuple):
    """A replica's state as it serves it (node/state_sync.py): after ``applied`` steps, hashing to ``state_hash``."""

    applied: int
    state_hash: str
    entries: list[tuple[str, Tensor]]
    self_test: bytes  # the output on the run's self-test input with this state, raw float32 (b"": none)
    leaves: list[tuple[str, str]]  # (name, digest) of the entries the hash covers: shared_leaves


def shared_entries(entries: Sequence[tuple[str, Tensor]], *, diloco: bool) -> list[tuple[str, Tensor]]:
    """Of a stage's state as named tensors (``param/<name>``, ``exp_avg/<name>``, ...: :meth:`StageWorker.snapshot`'s
    names), the ones every replica of the stage holds bit for bit (I2), in the order :func:`shared_state_hash`
    hashes them: the parameters in name order, then per parameter AdamW's step and moments; in DiLoCo mode
    (``diloco``, the parameters being the anchor) the outer momentum instead, each replica's inner AdamW state
    being its own. State not there yet (a fresh optimizer, a momentum of zeros) is left out, so the init and a
    final model's parameters hash as their parameters alone."""
    by_name = dict(entries)
    names = sorted(n.removeprefix(PARAM_PREFIX) for n in by_name if n.startswith(PARAM_PREFIX))
    out = [(f"{PARAM_PREFIX}{n}", by_name[f"{PARAM_PREFIX}{n}"]) for n in names]
    if diloco:
        momentum = [(f"{OUTER_KEY}/{n}", by_name[f"{OUTER_KEY}/{n}"]) for n in names if f"{OUTER_KEY}/{n}" in by_name]
        if any(bool(t.any()) for _, t in momentum):
            out += momentum
    else:
        out += [(f"{key}/{n}", by_name[f"{key}/{n}"]) for n in names for key in OPTIM_KEYS if f"{key}/{n}" in by_name]
    return out


def shared_leaves(entries: Sequence[tuple[str, Tensor]], *, diloco: bool) -> list[tuple[str, str]]:
    """(name, digest) of :func:`shared_entries`: what a donor sends ahead of its state, whose
    :func:`~protolearn.stages.stage.state_root` is its :func:`shared_state_hash`."""
    return state_leaves(shared_entries(entries, diloco=diloco))


def shared_state_hash(
    module: StageModule, optimizer: torch.optim.Optimizer, *, outer_momentum: Mapping[str, Tensor] | None = None,
) -> str:
    """The hash of the state that every replica of a stage holds bit for bit (I2): what the replicas report after
    each step, what a donor claims, what a joiner checks before it trains on a donor's state (a donor can lie
    about any tensor it sends, its optimizer state too), and what a checkpoint is matched against:
    :func:`~protolearn.stages.stage.state_root` of the digests of :func:`shared_entries` (in DiLoCo mode, with
    ``outer_momentum`` given, the parameters being the anchor)."""
    params = _params(module, optimizer)
    entries: list[tuple[str, Tensor]] = [(f"{PARAM_PREFIX}{n}", p) for n, p in params.items()]
    if outer_momentum is not None:
        entries += [(f"{OUTER_KEY}/{n}", m) for n, m in outer_momentum.items()]
    else:
        for name, p in params.items():
            st = optimizer.state.get(p, {})
            entries += [(f"{key}/{name}", st[key]) for key in OPTIM_KEYS if key in st]
    return state_root(shared_leaves(entries, diloco=outer_momentum is not None))


def state_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor in name order; bit-exact."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _describe(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)}"


def _check_names(source: str, spec: Spec, got: Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]], err: type[StageStateError]) -> None:
    """Names, dtypes and shapes of a state against ``spec``; dtype None means one we cannot hold at all."""
    for name, (dtype, shape) in got.items():
        want = spec.get(name)
        if want is None:
            raise err(source, f"unexpected tensor {name[:80]!r}; it is not part of this stage's state")
        if dtype != want[0] or tuple(shape) != want[1]:
            shown = _describe(dtype, shape) if dtype is not None else f"unsupported dtype {tuple(shape)}"
            raise err(source, f"tensor {name!r} is {shown}; this stage needs {_describe(*want)}")
    names = [n.partition("/")[2] for n in spec if n.startswith("param/")]
    missing = [n for n in names if f"param/{n}" not in got]
    if missing:
        raise err(source, f"lacks parameter {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + "; it is not a full state of this stage")
    for keys in (OPTIM_KEYS, (OUTER_KEY,)):
        if any(f"{k}/{n}" in got for n in names for k in keys):
            for n in names:
                for k in keys:
                    if f"{k}/{n}" not in got:
                        raise err(source, f"optimizer state is incomplete: {k}/{n} is missing")


@torch.no_grad()
def load_stage_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor], *, peer_or_path: str,
    outer: dict[str, Tensor] | None = None,
) -> None:
    """Install ``tensors`` (from :func:`stage_state`) into ``module`` and ``optimizer`` after checking it all;
    with ``outer`` (a DiLoCo run), the outer momentum entries are accepted and put there by parameter name.

    Every name must belong to the stage with the exact dtype and shape, every parameter must be there,
    the optimizer state must cover all parameters or none, values must be finite and the AdamW step a
    whole number equal for all parameters. On any problem a :class:`StageStateError` naming
    ``peer_or_path`` is raised and nothing has been changed.
    """
    params = _params(module, optimizer)
    spec = state_spec(module, outer=outer is not None)
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, Tensor):
            raise StageStateError(peer_or_path, f"entry {str(name)[:80]!r} is not a named tensor")
    _check_names(peer_or_path, spec, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, StageStateError)
    steps: set[float] = set()
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise StageStateError(peer_or_path, f"tensor {name!r} holds NaN or Inf")
        if name.startswith("step/"):
            v = float(t)
            if v < 0 or v != math.floor(v):
                raise StageStateError(peer_or_path, f"optimizer step {name!r} = {v} is not a whole number >= 0")
            steps.add(v)
    if len(steps) > 1:
        raise StageStateError(peer_or_path, f"optimizer steps differ between parameters ({sorted(steps)[:4]})")
    for name, p in params.items():
        p.copy_(tensors[f"param/{name}"].to(p.device))
    for name, p in params.items():
        optimizer.state.pop(p, None)
        if f"step/{name}" in tensors:
            # AdamW keeps `step` on the CPU (not capturable) and the moments beside the parameter.
            optimizer.state[p] = {
                "step": tensors[f"step/{name}"].to("cpu", copy=True),
                "exp_avg": tensors[f"exp_avg/{name}"].to(p.device, copy=True),
                "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device, copy=True),
            }
    if outer is not None:
        outer.clear()
        outer.update({n.partition("/")[2]: t.to("cpu", copy=True) for n, t in tensors.items() if n.startswith(f"{OUTER_KEY}/")})


# -- safetensors files --------------------------------------------------------------------------


@dataclass(frozen=True)
class SafetensorsHeader:
    size: int  # bytes of the JSON header
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


def read_header(path: Path) -> SafetensorsHeader:
    """The JSON header of a safetensors file, bounded and type-checked; CheckpointError if malformed."""
    src = str(path)
    try:
        with path.open("rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(src, f"file is {file_size} bytes, too short to be a safetensors file; it is truncated or not a checkpoint")
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES or 8 + size > file_size:
                raise CheckpointError(src, f"header length {size} does not fit a {file_size}-byte file; the file is truncated or not safetensors")
            raw = f.read(size)
    except FileNotFoundError:
        raise CheckpointError(src, "file not found; check the path") from None
    except IsADirectoryError:
        raise CheckpointError(src, "is a folder, not a checkpoint file") from None
    except OSError as err:
        raise CheckpointError(src, f"cannot read: {err.strerror}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(src, "header is not valid JSON; the file is corrupt or not safetensors") from None
    if not isinstance(doc, dict):
        raise CheckpointError(src, "header is not a JSON object; the file is corrupt or not safetensors")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(src, "metadata is not a string map; the file is corrupt")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in doc.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
        ok = ok and all(type(d) is int and 0 <= d < 2**40 for d in entry["shape"])
        if not ok:
            raise CheckpointError(src, f"tensor entry {name[:80]!r} is malformed; the file is corrupt")
        tensors[name] = (entry["dtype"], tuple(entry["shape"]))
    return SafetensorsHeader(size, file_size, meta, tensors)


def read_tensors(path: Path, header: SafetensorsHeader, spec: Spec) -> dict[str, Tensor]:
    """Check the tensor table against ``spec`` and the file size, then read and decode the tensors."""
    src = str(path)
    by_code = {code: dtype for dtype, code in _DTYPES.items()}
    table = {n: (by_code.get(code), shape) for n, (code, shape) in header.tensors.items()}
    _check_names(src, spec, table, CheckpointError)
    data = sum(math.prod(shape) * dtype.itemsize for dtype, shape in table.values() if dtype is not None)
    if header.file_size != 8 + header.size + data:
        raise CheckpointError(src, f"file is {header.file_size} bytes but its tensors need {8 + header.size + data}; it is truncated or corrupt")
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise CheckpointError(src, f"cannot read: {err.strerror}") from None
    try:
        return st_load(blob)
    except SafetensorError as err:
        raise CheckpointError(src, f"safetensors cannot decode it ({' '.join(str(err).split())[:200]}); the file is corrupt") from None


def write_atomic(path: Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` via a temp file in the same folder, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # make the rename itself durable
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(str(path), f"cannot write: {err.strerror}: the disk is full; free some space there") from None
        raise CheckpointError(str(path), f"cannot write: {err.strerror}; check the folder exists and is writable") from None
    finally:
        if tmp.exists():  # left behind only when writing failed
            tmp.unlink()


def int_meta(src: str, meta: dict[str, str], key: str) -> int:
    value = meta.get(key, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        raise CheckpointError(src, f"metadata {key!r}={value[:20]!r} is not a whole number; the file is corrupt")
    return int(value)


# -- stage checkpoints --------------------------------------------------------------------------


def checkpoint_name(stage: int, step: int) -> str:
    return f"stage-{stage}-step-{step}.safetensors"


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """The metadata of a stage checkpoint, reading only its header."""
    path = Path(path)
    meta = read_header(path).metadata
    if meta.get("format") != STAGE_FORMAT:
        raise CheckpointError(str(path), f"not a protolearn stage checkpoint (format {meta.get('format', 'missing')[:40]!r}, want {STAGE_FORMAT!r})")
    src = str(path)
    return CheckpointInfo(
        path=path, stage=int_meta(src, meta, "stage"), step=int_meta(src, meta, "step"),
        num_stages=int_meta(src, meta, "num_stages"), run_hash=meta.get("run_hash", ""),
        state_hash=meta.get("state_hash", ""), state_digest=meta.get("state_digest", ""), run_toml=meta.get("run_toml", ""),
    )


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A stage's state taken for a checkpoint (copies: the module may train on), not yet written."""

    directory: Path
    path: Path
    stage: int
    run_hash: str
    state: dict[str, Tensor]
    meta: dict[str, str]


def prepare_checkpoint(
    directory: str | Path, run: RunConfig, stage: int, step: int, module: StageModule, optimizer: torch.optim.Optimizer,
    *, outer_momentum: Mapping[str, Tensor] | None = None,
) -> PreparedCheckpoint:
    """Take stage ``stage`` after ``step`` applied steps for :func:`write_checkpoint`: the part that reads the module."""
    if module.stage != stage or module.run_config.run_hash() != run.run_hash():
        raise ValueError(f"module is stage {module.stage} of run {module.run_config.run_hash()[:12]}, not stage {stage} of {run.run_hash()[:12]}")
    meta = {
        "format": STAGE_FORMAT, "run_hash": run.run_hash(), "run_toml": run.to_toml(), "stage": str(stage),
        "step": str(step), "num_stages": str(module.plan.num_stages),
        "state_hash": shared_state_hash(module, optimizer, outer_momentum=outer_momentum),
    }
    state = stage_state(module, optimizer, outer_momentum=outer_momentum)
    return PreparedCheckpoint(Path(directory), Path(directory) / checkpoint_name(stage, step), stage, run.run_hash(), state, meta)


def write_checkpoint(prepared: PreparedCheckpoint, *, keep: int = DEFAULT_KEEP) -> Path:
    """Write ``prepared`` atomically; keep its run's newest ``keep`` checkpoints of the stage."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    p = prepared
    write_atomic(p.path, st_save(p.state, metadata={**p.meta, "state_digest": state_digest(p.state)}))
    old = [i for i in list_checkpoints(p.directory) if i.stage == p.stage and i.run_hash == p.run_hash and i.path != p.path]
    for info in sorted(old, key=lambda i: i.step)[: max(0, len(old) + 1 - keep)]:
        info.path.unlink(missing_ok=True)
    return p.path


def save_checkpoint(
    directory: str | Path, run: RunConfig, stage: int, step: int, module: StageModule, optimizer: torch.optim.Optimizer,
    *, keep: int = DEFAULT_KEEP, outer_momentum: Mapping[str, Tensor] | None = None,
) -> Path:
    """Write stage ``stage`` after ``step`` applied steps atomically; keep this run's newest ``keep`` of the stage.
    ``outer_momentum``: DiLoCo's, by parameter name (the module then holds the state after the last outer sync)."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    return write_checkpoint(prepare_checkpoint(directory, run, stage, step, module, optimizer, outer_momentum=outer_momentum), keep=keep)


def run_folder(run: RunConfig) -> str:
    """The folder a node keeps one run's checkpoints in, under ``<data dir>/checkpoints``: its name and hash."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run.name)[:64] or "run"
    return f"{name}-{run.run_hash()[:12]}"


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """The readable stage checkpoints in ``directory`` and its immediate subfolders (one per run, see
    :func:`run_folder`); temp files and other names are ignored."""
    d = Path(directory)
    if not d.is_dir():
        return []
    infos = []
    files = sorted(p for p in d.iterdir() if p.is_file())
    files += sorted(f for sub in sorted(d.iterdir()) if sub.is_dir() for f in sub.iterdir() if f.is_file())
    for p in files:
        m = _FILE.match(p.name)
        if m is None or not p.is_file():
            continue
        try:
            info = read_checkpoint_info(p)
        except CheckpointError as err:
            log.warning("skipping unreadable checkpoint %s", err)
            continue
        if (info.stage, info.step) != (int(m[1]), int(m[2])):
            log.warning("skipping checkpoint %s: it holds stage %d step %d", p, info.stage, info.step)
            continue
        infos.append(info)
    return infos


def latest_checkpoint(directory: str | Path, stage: int | None = None) -> CheckpointInfo | None:
    """The newest readable checkpoint in ``directory`` (of ``stage``, if given), or None."""
    infos = [i for i in list_checkpoints(directory) if stage is None or i.stage == stage]
    return max(infos, key=lambda i: (i.step, i.stage), default=None)


def load_checkpoint(
    path: str | Path, run: RunConfig, stage: int, module: StageModule, optimizer: torch.optim.Optimizer, *,
    outer: dict[str, Tensor] | None = None,
) -> int:
    """Load a stage checkpoint into ``module``/``optimizer``; returns its step (optimizer steps applied).
    ``outer``: a DiLoCo run's outer momentum goes there (see :func:`load_stage_state`).

    A checkpoint of another run or stage, a malformed or truncated file, or one whose parameters do
    not match the digest it recorded is a :class:`CheckpointError`; the module is then unchanged.
    """
    path = Path(path)
    info = read_checkpoint_info(path)
    src = str(path)
    if info.run_hash != run.run_hash():
        raise CheckpointError(src, f"belongs to run {info.run_hash[:12]}, not this run {run.run_hash()[:12]}; use a checkpoint of this run or its run config")
    if info.stage != stage:
        raise CheckpointError(src, f"holds stage {info.stage}, not stage {stage}; pick the file named stage-{stage}-step-*.safetensors")
    tensors = read_tensors(path, read_header(path), state_spec(module, outer=outer is not None))
    if state_digest(tensors) != info.state_digest:
        raise CheckpointError(src, "its tensors do not match the digest recorded when it was saved; the file is corrupt")
    load_stage_state(module, optimizer, tensors, peer_or_path=src, outer=outer)
    return info.step
