"""A simulated swarm's scenario: the run, the nodes' hardware and links, churn, and the coordinator's settings.

A scenario is a TOML file (``scripts/scenarios/*.toml``, or the built-in ``default.toml`` beside this module:
a 7B-class model in 32 stages) read into a frozen :class:`Scenario`; the command
line of ``scripts/simulate.py`` overrides its main knobs. Every random draw of the simulation comes from
the scenario's ``seed``, so a scenario and a seed give one run.

- ``[swarm]``: how many nodes (the size churn keeps the swarm at), how many stages, how long to simulate.
- ``[run]``: a protolearn run config (the same tables as ``coordinator start --config``), laid over the
  built-in demo run; ``[swarm] stages`` sets its ``stages.num_stages``. The model's FLOPs and the codec's
  bytes per token come from it (:mod:`.costs`), and the coordinator core gets it as it gets a real run.
- ``[hardware]``: each node draws its compute (effective TFLOPS, log-normal around ``tflops``) and one
  of the ``links`` (the link grammar of ``protolearn demo --link``, asymmetric home links included),
  by weight.
- ``[churn]``: nodes live an exponentially distributed time of mean ``mean_lifetime`` and then leave
  (``graceful_share`` of them with a Leave, the others crash); new nodes arrive at the rate that keeps
  the swarm at its size. ``trace`` replaces both with a file of ``time,event,node`` lines (events
  ``join``, ``leave``, ``crash``). ``coordinator_restart_at`` crashes the coordinator once and restores it
  from its SQLite store after ``coordinator_outage``.
- ``[coordinator]``: :class:`~protolearn.coordinator.config.CoordinatorSettings` fields.
- ``[node]``: the node's own knobs the simulation honours (in-flight microbatches, lease block, timeouts).
- ``[sim]``: fidelity knobs: how many next-stage candidates a routing decision considers (0: every peer
  in view, as the node does; a sample otherwise, see :mod:`.pipeline`), and the largest averaging group
  that runs the real :class:`~protolearn.protocol.collective.CollectiveRound` message by message (larger
  ones are timed by the round model, :mod:`.round_model`).

Durations are numbers of seconds or strings like ``90s``, ``15m``, ``2h``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.errors import ConfigError
from protolearn.protocol.link import LinkSpec, parse_link
from protolearn.stages.config import RunConfig, default_run, validate_run

# The built-in scenario: a 7B-class model in 32 stages on home links (what the scale curves run).
DEFAULT_SCENARIO = Path(__file__).with_name("default.toml")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, *, field: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"``; ConfigError names ``field``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{field}: {value} is negative; give a duration like 90s, 15m or 2h")
        return float(value)
    m = _DURATION.match(str(value).lower())
    if m is None:
        raise ConfigError(f"{field}: {value!r} is not a duration; write it like 90s, 15m, 2h or 1d")
    return float(m.group(1)) * _UNITS[m.group(2)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class SwarmSpec(_Frozen):
    nodes: int = Field(6, ge=1, le=1_000_000)
    stages: int = Field(3, ge=1, le=256)
    hours: float = Field(0.1, gt=0)
    seed: int = Field(0, ge=0)
    # The initial nodes join over this long (a real swarm does not appear at one instant).
    ramp_s: float = Field(5.0, ge=0)


class LinkChoice(_Frozen):
    spec: str
    weight: float = Field(1.0, gt=0)

    @field_validator("spec")
    @classmethod
    def _parses(cls, v: str) -> str:
        parse_link(v)
        return v


class HardwareSpec(_Frozen):
    # Effective (achieved) TFLOPS of a node's accelerator: log-normal with this median and sigma (0: all equal).
    tflops: float = Field(30.0, gt=0)
    tflops_sigma: float = Field(0.4, ge=0, le=3)
    links: tuple[LinkChoice, ...] = (LinkChoice(spec="up=20mbit,down=100mbit,20ms", weight=1.0),)
    # The memory each node offers at join (0: not said, every stage fits; coordinator/core/fit.py).
    memory_gb: float = Field(0.0, ge=0)

    def link_specs(self) -> list[tuple[LinkSpec, float]]:
        return [(parse_link(c.spec), c.weight) for c in self.links]


class ChurnSpec(_Frozen):
    # Mean node lifetime (exponential); 0: nobody leaves.
    mean_lifetime_s: float = Field(0.0, ge=0)
    # Of the departures, the share that leave gracefully (a Leave request); the rest crash.
    graceful_share: float = Field(0.5, ge=0, le=1)
    # Of the crashes, the share whose connection to the coordinator closes at once (a killed process); the
    # rest go silent (a machine that lost power or its network) and are found by expiry.
    crash_closes_share: float = Field(0.5, ge=0, le=1)
    # A trace file (time,event,node per line; events join, leave, crash) instead of the distributions.
    trace: str | None = None
    coordinator_restart_at_s: float | None = Field(None, ge=0)
    coordinator_outage_s: float = Field(10.0, ge=0)


class NodeSpec(_Frozen):
    max_in_flight: int = Field(8, ge=1)
    lease_block: int = Field(2, ge=1)
    max_deferred: int = Field(16, ge=1)
    # A forward send's whole deadline (node config request_timeout_s): also stage 0's stall bound per stage.
    request_timeout_s: float = Field(30.0, gt=0)
    averaging_timeout_s: float = Field(120.0, gt=0)


class SimSpec(_Frozen):
    # Next-stage peers one routing decision considers: 0 = every peer in view (the node's own rule); k > 0 =
    # a seeded sample of k of them (the power-of-k-choices model of the balancer, for very large stages).
    route_candidates: int = Field(0, ge=0)
    # Averaging groups up to this size run the real CollectiveRound message by message; larger ones the round model.
    real_round_max: int = Field(4, ge=0, le=64)
    # The departure repair (issue 26): a departed replica's upstream sends on the activations it held (False: the
    # protocol before it, where stage 0 restarts every ticket in flight when any later-stage replica leaves).
    repair_departures: bool = True
    # When set, the run's microbatches per step are this many per replica (nodes / stages of them): a bigger
    # swarm trains a bigger batch, so node-count curves compare like with like.
    microbatches_per_replica: float | None = Field(None, gt=0)
    # The replica-sync compression rounds are timed with (none, int8, topk:F, powersgd:R; costs.py).
    sync_compression: str = "none"


class Scenario(_Frozen):
    name: str = "scenario"
    swarm: SwarmSpec = Field(default_factory=SwarmSpec)
    run: RunConfig = Field(default_factory=default_run)
    hardware: HardwareSpec = Field(default_factory=HardwareSpec)
    churn: ChurnSpec = Field(default_factory=ChurnSpec)
    coordinator: CoordinatorSettings = Field(default_factory=CoordinatorSettings)
    node: NodeSpec = Field(default_factory=NodeSpec)
    sim: SimSpec = Field(default_factory=SimSpec)

    @property
    def duration_s(self) -> float:
        return self.swarm.hours * 3600.0

    def with_overrides(self, **updates: Any) -> Scenario:
        """A validated copy with dotted-path updates (``swarm.nodes``, ``churn.mean_lifetime_s``, ...)."""
        raw = self.model_dump(mode="json")
        for dotted, value in updates.items():
            *parents, leaf = dotted.split(".")
            target = raw
            for key in parents:
                target = target.setdefault(key, {})
            target[leaf] = value
        return _validate(raw, source="override")


_DURATION_FIELDS = {
    ("churn", "mean_lifetime"): "mean_lifetime_s",
    ("churn", "coordinator_restart_at"): "coordinator_restart_at_s",
    ("churn", "coordinator_outage"): "coordinator_outage_s",
    ("swarm", "ramp"): "ramp_s",
}


def _validate(raw: dict[str, Any], *, source: str) -> Scenario:
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for (table, key), field in _DURATION_FIELDS.items():
        section = raw.get(table)
        if isinstance(section, dict) and key in section:
            section[field] = parse_duration(section.pop(key), field=f"{table}.{key}")
    stages = raw.get("swarm", {}).get("stages", SwarmSpec().stages)
    run_raw = raw.get("run", {})
    if not isinstance(run_raw, dict):
        raise ConfigError(f"{source}: [run] must be a table of run config fields")
    base = default_run().model_dump(mode="json")
    merged = _merge(base, run_raw)
    merged.setdefault("stages", {})["num_stages"] = stages
    if merged["stages"].get("layers") and len(merged["stages"]["layers"]) != stages:
        merged["stages"]["layers"] = None  # a layer split for another stage count: split evenly instead
    per_replica = raw.get("sim", {}).get("microbatches_per_replica")
    if per_replica is not None:
        nodes = raw.get("swarm", {}).get("nodes", SwarmSpec().nodes)
        merged.setdefault("batch", {})["microbatches_per_step"] = max(1, round(float(per_replica) * nodes / stages))
    raw["run"] = validate_run(merged, source=f"{source} [run]")
    try:
        return Scenario.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{source}: {where}: {first['msg']}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_scenario(path: str | Path | None) -> Scenario:
    """The scenario in ``path`` (TOML), or with none the built-in one (:data:`DEFAULT_SCENARIO`)."""
    p = DEFAULT_SCENARIO if path is None else Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"scenario {p}: cannot read it ({err.strerror}); give a TOML file like scripts/scenarios/demo.toml") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"scenario {p}: TOML syntax error: {err}; fix the file") from None
    raw.setdefault("name", "default" if path is None else p.stem)
    return _validate(raw, source=f"scenario {p}")
