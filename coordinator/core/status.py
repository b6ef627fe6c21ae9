"""The swarm view behind `swarm status`: verdict, stages, nodes, loss history, and its JSON schema.

:func:`build_status` reads the core at ``now`` and returns a :class:`~protolearn.protocol.status_schema.Status`
message. Its JSON form (``status.model_dump(mode="json")``, what ``swarm status --json`` prints) is
described by :data:`STATUS_JSON_SCHEMA`, which is stable: fields may be added in a new
``schema_version``, never renamed or removed.

The verdict, in order of precedence:

- ``finished``: every step of the run has committed (schema 4; the nodes have left or are leaving, and
  ``final_step`` says whether the coordinator holds the final model, which ``swarm export`` fetches);
- ``halted``: no member at all, or a stage with zero replicas (training cannot proceed);
- ``degraded``: training proceeds but something needs attention: a stage's replicas have no
  majority parameter hash (I2), a member has missed heartbeats, no step has closed for a long time, or
  the last closed step's commit has waited on one replica for a while (the verdict names its stage, the
  replica and for how long: ``holdups.py``);
- ``healthy`` otherwise. ``healthy`` (the boolean) is ``verdict == "healthy"``.

``at_risk`` (schema 4) lists the stages with a single live replica: one failure halts them (a table
shows such a swarm as AT RISK rather than HEALTHY). ``eta_s`` is the time to the run's last step at the
pace of the recent steps, ``run.steps`` the run's steps, and each node's ``name`` what it joined with.

Node flags: ``stale`` (missed two heartbeats), ``hash-mismatch`` (its parameter hash differs from
its stage's majority at the same step), ``behind`` (it reports an older step than its stage's),
``no-throughput`` (it has not measured any yet), and the verdict policy's conduct flags as
``kind:strikes`` (``redo_storm``, ``result_mismatch``, ``late_leases``, ``lost_microbatches``, ``integrity``,
``commit_hold``; see ``verdicts.py``).

NAT traversal (schema 3, ``coordinator/core/reachability.py``): each node's ``reachability`` is the
coordinator's own verdict from dialling it back (``public``, ``private`` or ``unknown``), and ``path``
how its stage peers reach it (``direct``, ``relayed``, ``hole-punched``) as its last heartbeat says.

Integrity (schema 2, ``coordinator/core/integrity.py``): each node's ``integrity`` is the median of the
boundary-monitor scores its checkers report in their heartbeats, ``probation`` their majority state,
``checks_passed``/``checks_failed`` the spot checks they ran on it, and ``evidence`` the integrity
reports against it that reached a verdict (persisted). These are claims by its neighbours, shown, never
acted on: only evidence the coordinator verifies itself bans.

Reports are claims, so one replica cannot decide what a stage looks like: a stage's ``param_step`` is
the lower median of the steps its replicas report (a lone claim of a huge step moves nothing), and
``hashes_agree`` means a strict majority of the replicas at that step hold one hash
(:func:`~protolearn.protocol.majority.majority_state`); a lone liar is flagged ``hash-mismatch``
instead of flipping its stage's verdict.

Bounded: the status stays under the frame cap at any swarm size. It lists at most
:data:`MAX_STATUS_NODES` nodes (flagged ones first) and at most :data:`MAX_STATUS_HASHES` parameter
hashes over all stages; a stage's ``replicas`` always counts every one, so ``len(nodes)`` below the
sum of ``replicas`` says the list was cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol, get_args

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.final_model import FinalModelDesk
from protolearn.coordinator.core.gathering import Gathering
from protolearn.coordinator.core.history import LossRecord
from protolearn.coordinator.core.holdups import Holdups, Waiting
from protolearn.coordinator.core.integrity import IntegrityDesk
from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.outer_desk import OuterDesk
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol import status_schema as ss
from protolearn.protocol.majority import majority_state

# 2: nodes carry integrity, probation, checks_passed, checks_failed and evidence.
# 3: nodes carry reachability and path (NAT traversal).
# 4: nodes carry their name; the run its steps; the status at_risk, eta_s, final_step; a "finished" verdict.
# 5: DiLoCo: the run its sync mode and inner_steps; stages their last outer round; nodes their inner step.
SCHEMA_VERSION = 5
# tokens/s is measured over this many of the most recent closed steps.
RATE_WINDOW = 10
# No step closed for this long (and this many average step times) while not halted: degraded.
STALL_S = 60.0
STALL_STEPS = 5.0
# The verdict names the replica the last closed step's commit waits on once it has waited this long, or
# 2 step times if longer (a swarm on slow links averages for a while every step).
WAITING_SHOWN_S = 5.0
# Most nodes, and parameter hashes over all stages, one status lists (~0.2 KiB each; see the docstring).
MAX_STATUS_NODES = 8192
MAX_STATUS_HASHES = 4096

# A persisted member's text is checked against the wire's choices, so a bad row cannot break the status.
_REACH = frozenset(get_args(cm.Reachability))
_PATHS = frozenset(get_args(cm.NodePath))
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STR = {"type": "string"}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": sorted(props), "properties": props, "additionalProperties": False}


STATUS_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "protolearn swarm status",
    "description": "Output of `protolearn swarm status --json` (schema_version 5).",
    **_obj(
        {
            "schema_version": {"const": SCHEMA_VERSION},
            "coordinator": {**_STR, "description": "the coordinator's peer ID"},
            "uptime_s": _NUM,
            "run": _obj(
                {
                    "name": _STR,
                    "run_hash": _STR,
                    "num_stages": _INT,
                    "microbatches_per_step": _INT,
                    "tokens_per_step": _INT,
                    "steps": {**_INT, "description": "the run's optimizer steps (0: not said)"},
                    "sync": {"enum": ["step", "diloco"], "description": "replicas average every step, or DiLoCo outer syncs"},
                    "inner_steps": {**_INT, "description": "DiLoCo: inner steps between outer syncs (0 otherwise)"},
                }
            ),
            "step": {**_INT, "description": "the open step (the next to close)"},
            "last_closed": {**_INT, "description": "the last closed step, -1 if none"},
            "last_committed": {
                **_INT,
                "description": "the last step every stage averaged in full, which replicas then apply; "
                "below last_closed while the stages average it",
            },
            "healthy": {"type": "boolean", "description": "verdict == healthy"},
            "verdict": {"enum": ["healthy", "degraded", "halted", "finished"]},
            "verdict_reason": _STR,
            "at_risk": {"type": "array", "items": _INT, "description": "stages with a single live replica: one failure halts them"},
            "eta_s": {"type": ["number", "null"], "description": "seconds to the run's last step at the recent pace; null when not training"},
            "final_step": {**_INT, "description": "the step of the finished run's model the coordinator holds, -1 if none"},
            "tokens_per_s": _NUM,
            "loss": {"type": ["number", "null"], "description": "mean loss of the last closed step"},
            "loss_history": {
                "type": "array",
                "items": _obj({"step": _INT, "loss": _NUM, "tickets": _INT, "closed_at": _NUM}),
            },
            "stages": {
                "type": "array",
                "items": _obj(
                    {
                        "index": _INT,
                        "layers": _INT,
                        "replicas": _INT,
                        "throughput": _NUM,
                        "param_step": {**_INT, "description": "the lower median of the steps its replicas report applied, -1 if none"},
                        "param_hashes": {
                            "type": "array",
                            "items": _obj({"peer_id": _STR, "step": _INT, "hash": _STR}),
                        },
                        "hashes_agree": {"type": "boolean", "description": "a strict majority of the replicas at param_step hold one hash"},
                        "outer": {
                            "anyOf": [
                                {"type": "null"},
                                _obj(
                                    {
                                        "round": _INT, "attempt": _INT,
                                        "step": {**_INT, "description": "the inner step the round synced after"},
                                        "decided_at": _NUM,
                                        "quorum": {**_INT, "description": "the replicas the round needed (quorum, at most the live ones)"},
                                        "participants": {"type": "array", "items": _STR},
                                        "followers": {"type": "array", "items": _STR},
                                        "left_out": {"type": "array", "items": _obj({"peer_id": _STR, "reason": _STR})},
                                    }
                                ),
                            ],
                            "description": "DiLoCo: the stage's last outer round (null: none yet, or per-step averaging)",
                        },
                    }
                ),
            },
            "nodes": {
                "type": "array",
                "items": _obj(
                    {
                        "peer_id": _STR,
                        "name": {**_STR, "description": "the name it joined with (node join --name); empty if none"},
                        "stage": _INT,
                        "state": {"enum": list(cm.NODE_STATES)},
                        "last_seen_s": _NUM,
                        "throughput": _NUM,
                        "queue_len": _INT,
                        "step": _INT,
                        "loss": {"type": ["number", "null"]},
                        "flags": {"type": "array", "items": _STR},
                        "integrity": {"type": ["number", "null"], "description": "median boundary-monitor score its checkers report; >= 1 is a suspect"},
                        "probation": {"enum": ["", "probation", "trusted", "failed"]},
                        "checks_passed": _INT,
                        "checks_failed": _INT,
                        "evidence": {**_INT, "description": "integrity reports against it that reached a verdict"},
                        "reachability": {
                            "enum": list(get_args(cm.Reachability)),
                            "description": "the coordinator's verdict from dialling it back: public, private (behind a NAT) or unknown",
                        },
                        "path": {
                            "enum": list(get_args(cm.NodePath)),
                            "description": "how its stage peers reach it, from its last heartbeat; empty until it said",
                        },
                        "inner_step": {**_INT, "description": "DiLoCo: the last inner step it applied (-1: not said); step is its last outer sync's"},
                    }
                ),
            },
            "bans": {"type": "array", "items": _obj({"peer_id": _STR, "reason": _STR, "at": _NUM})},
        }
    ),
}


def tokens_per_s(history: list[ss.LossPoint], tokens_per_step: int, now: float) -> float:
    """Tokens per second over the last closed steps; 0 once the swarm has stalled."""
    window = history[-RATE_WINDOW:]
    if len(window) < 2:
        return 0.0
    span = window[-1].closed_at - window[0].closed_at
    if span <= 0:
        return 0.0
    if _stalled(now - window[-1].closed_at, span / (len(window) - 1)):
        return 0.0
    return (len(window) - 1) * tokens_per_step / span


def _stalled(idle_s: float, step_s: float) -> bool:
    """Whether no step for ``idle_s`` is a stall, when steps take ``step_s`` on average."""
    return idle_s > max(STALL_S, STALL_STEPS * step_s)


class StatusSource(Protocol):
    """What the status is read from: the coordinator core's parts (it is one)."""

    @property
    def run(self) -> RunInfo: ...
    @property
    def settings(self) -> CoordinatorSettings: ...
    @property
    def peer_id(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def ledger(self) -> TicketLedger: ...
    @property
    def verdicts(self) -> VerdictPolicy: ...
    @property
    def history(self) -> Iterable[LossRecord]: ...
    @property
    def integrity(self) -> IntegrityDesk: ...
    @property
    def final_model(self) -> FinalModelDesk: ...
    @property
    def holdups(self) -> Holdups: ...
    @property
    def outer(self) -> OuterDesk | None: ...
    @property
    def gathering(self) -> Gathering: ...


def build_status(core: StatusSource, now: float, history_len: int = 200) -> ss.Status:
    """The status at ``now``; O(members), bounded in size (see the module docstring)."""
    run, settings, ledger = core.run, core.settings, core.ledger
    live = sorted(core.registry.live(), key=lambda m: (m.stage, m.peer_id))
    history = [
        ss.LossPoint(step=p.step, loss=float(p.loss), tickets=p.tickets, closed_at=float(p.closed_at))
        for p in core.history
        if p.step < ledger.step
    ]

    by_stage: dict[int, list[Member]] = {}
    for m in live:
        by_stage.setdefault(m.stage, []).append(m)
    stages: list[ss.StageView] = []
    flags: dict[str, list[str]] = {m.peer_id: [] for m in live}
    hashes_per_stage = max(1, MAX_STATUS_HASHES // max(1, run.num_stages))
    for s in range(run.num_stages):
        members = by_stage.get(s, [])
        reported = [m for m in members if m.param_hash]
        steps = sorted(m.step for m in reported)
        param_step = steps[(len(steps) - 1) // 2] if steps else -1
        current = [m for m in reported if m.step == param_step]
        majority = majority_state((m.step, m.param_hash) for m in current)
        agree = majority is not None or not current
        for m in members:
            if m.param_hash and m.step < param_step:
                flags[m.peer_id].append("behind")
        top = majority[1] if majority else Counter(m.param_hash for m in current).most_common(1)[0][0] if current else ""
        for m in current:
            if m.param_hash != top:
                flags[m.peer_id].append("hash-mismatch")
        # Flagged replicas first, then the rest, up to this stage's part of the bound.
        reported.sort(key=lambda m: (not flags[m.peer_id], m.peer_id))
        reported = sorted(reported[:hashes_per_stage], key=lambda m: m.peer_id)
        stages.append(
            ss.StageView(
                index=s,
                layers=run.layers[s],
                replicas=len(members),
                throughput=float(sum(m.throughput for m in members)),
                param_step=param_step,
                param_hashes=[cm.ParamHash(peer_id=m.peer_id, step=m.step, hash=m.param_hash) for m in reported],
                hashes_agree=agree,
                outer=_outer_view(core, s),
            )
        )

    nodes: list[ss.NodeView] = []
    for m in live:
        since = max(0.0, now - m.last_seen)
        f = flags[m.peer_id]
        if since > 2 * core.registry.heartbeat_interval_s:
            f.insert(0, "stale")
        if m.throughput <= 0:
            f.append("no-throughput")
        f.extend(core.verdicts.flags_of(m.peer_id))
        score, probation, passed, failed = core.integrity.summary(m.peer_id, core.registry.is_live)
        nodes.append(
            ss.NodeView(
                peer_id=m.peer_id, name=m.name[:64], stage=m.stage, state=m.state, last_seen_s=float(since),
                throughput=float(m.throughput), queue_len=m.queue_len, step=m.step,
                loss=None if m.loss is None else float(m.loss), flags=f,
                integrity=score, probation=probation, checks_passed=passed, checks_failed=failed,
                evidence=core.integrity.against.get(m.peer_id, 0),
                reachability=m.reachability if m.reachability in _REACH else "unknown",
                path=m.path if m.path in _PATHS else "",
                inner_step=m.inner_step,
            )
        )

    final = core.final_model
    finished, final_step = final.finished, final.held_step
    if finished:
        verdict, why = "finished", _finished_reason(run.steps, history, final.state if settings.keep_final else "off", final_step)
    else:
        verdict, why = _verdict(stages, nodes, history, now, core.holdups.waiting, core.gathering.waiting(len(live)))
    rate = tokens_per_s(history, run.tokens_per_step, now)
    if len(nodes) > MAX_STATUS_NODES:  # flagged nodes first, then by stage and peer ID
        nodes = sorted(sorted(nodes, key=lambda n: not n.flags)[:MAX_STATUS_NODES], key=lambda n: (n.stage, n.peer_id))
    return ss.Status(
        schema_version=SCHEMA_VERSION,
        coordinator=core.peer_id,
        uptime_s=float(max(0.0, now - core.started_at)),
        run=ss.RunView(
            name=run.name, run_hash=run.run_hash, num_stages=run.num_stages,
            microbatches_per_step=run.microbatches_per_step, tokens_per_step=run.tokens_per_step, steps=run.steps,
            sync="diloco" if run.outer is not None else "step", inner_steps=run.outer.inner_steps if run.outer is not None else 0,
        ),
        step=ledger.step,
        last_closed=ledger.last_closed,
        last_committed=ledger.committed_through,
        healthy=verdict == "healthy",
        verdict=verdict,
        verdict_reason=why,
        at_risk=[st.index for st in stages if st.replicas == 1],
        eta_s=None if finished else eta_s(history, run.steps, ledger.committed_through, rate, run.tokens_per_step),
        final_step=final_step,
        tokens_per_s=float(rate),
        loss=history[-1].loss if history else None,
        loss_history=history[-history_len:] if history_len else [],
        stages=stages,
        nodes=nodes,
        bans=[ss.BanView(peer_id=b.peer_id, reason=b.reason, at=float(b.at)) for b in core.verdicts.bans.values()],
    )


def _outer_view(core: StatusSource, stage: int) -> ss.OuterView | None:
    """A DiLoCo stage's last outer round, as the coordinator decided it (outer_rounds.py)."""
    d = core.outer.last(stage) if core.outer is not None else None
    if d is None:
        return None
    return ss.OuterView(
        round=d.round, attempt=d.attempt, step=core.run.outer.boundary(d.round) if core.run.outer is not None else -1,
        decided_at=float(d.at), quorum=d.quorum, participants=sorted(d.weights), followers=list(d.followers),
        left_out=[ss.LeftOut(peer_id=p, reason=why) for p, why in sorted(d.left_out.items())],
    )


def eta_s(history: list[ss.LossPoint], steps: int, committed: int, rate: float, tokens_per_step: int) -> float | None:
    """Seconds to the run's last step at the recent pace (``rate`` tokens/s); None while not training."""
    if steps <= 0 or rate <= 0 or tokens_per_step <= 0:
        return None
    return max(0, steps - 1 - committed) * tokens_per_step / rate


def _finished_reason(steps: int, history: list[ss.LossPoint], final_state: str, final_step: int) -> str:
    loss = f", final loss {history[-1].loss:.4f}" if history else ""
    if final_state == "saved":
        where = f"the coordinator holds the model after step {final_step}: `protolearn swarm export` fetches it"
    elif final_state in ("failed", "off"):
        why = "could not fetch" if final_state == "failed" else "does not keep"
        where = f"the coordinator {why} the final model: export it from the nodes' checkpoints (protolearn export --checkpoints)"
    else:
        where = "the nodes stay until the coordinator has fetched the final model"
    return f"all {steps} steps done{loss}; {where}"


def _verdict(
    stages: list[ss.StageView], nodes: list[ss.NodeView], history: list[ss.LossPoint], now: float, waiting: Waiting | None = None,
    gathering: str | None = None,
) -> tuple[str, str]:
    if not nodes:
        return "halted", "no nodes have joined; start one with `protolearn node join`"
    if gathering is not None:
        return "halted", gathering
    empty = [s.index for s in stages if s.replicas == 0]
    if empty:
        names = ", ".join(str(i) for i in empty)
        return "halted", f"stage {names} has no replicas: training is halted until a node joins it"
    problems = []
    per_step = (history[-1].closed_at - history[0].closed_at) / max(1, len(history) - 1) if len(history) >= 2 else 0.0
    split = [s.index for s in stages if not s.hashes_agree]
    if split:
        problems.append(f"replicas of stage {', '.join(map(str, split))} disagree on their parameter hash")
    stale = [n.peer_id for n in nodes if "stale" in n.flags]
    if stale:
        problems.append(f"{len(stale)} node(s) missed heartbeats")
    if len(history) >= 2:
        idle = now - history[-1].closed_at
        if _stalled(idle, per_step):
            problems.append(f"no step has closed for {idle:.0f} s")
    if waiting is not None and waiting.for_s >= max(WAITING_SHOWN_S, 2 * per_step):
        problems.append(waiting.line())
    if problems:
        return "degraded", "; ".join(problems)
    return "healthy", f"every stage has replicas ({', '.join(str(s.replicas) for s in stages)})"
