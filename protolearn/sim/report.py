"""The report of a simulated run: one flat dict (``--json``) and a few readable lines.

Keys (durations in seconds, shares in [0, 1]):

- ``nodes``, ``stages``, ``sim_s``, ``wall_s``, ``events``: what ran, and how long it took here;
- ``goodput`` (see :mod:`.metrics`), ``node_time_goodput``, ``busy_share``, and the work's parts:
  ``useful_compute_s``, ``wasted_compute_s``, ``useful_avg_s``, ``wasted_avg_s``, ``sync_s``, ``node_s``;
- ``steps``, ``step_s`` (median seconds between commits once training runs), ``tokens_per_s``
  (committed tokens over the time from the first commit to the end);
- ``boundary_bytes_per_token``: bytes sent across each boundary (activations and gradients, every attempt)
  per committed token, and ``codec_bytes_per_token``, the codec's own (fwd, bwd) per token and boundary;
  ``sync_bytes_per_token``: replica averaging's bytes (all replicas) per committed token;
- ``round_failures_per_step``, ``exclusions_per_step``, ``reopens_per_step``, ``redone_tickets_per_step``;
- ``recover_s`` (p50, p90, max: from a crash to the commit of the first step that closed after it) and
  ``detect_s`` (p50, p90: from a crash to the coordinator's view dropping the node);
- ``empty_neighbour_share``: the share of time a stage has a neighbouring stage with no serving replica;
- ``coordinator_cpu_per_s``: the coordinator core's CPU seconds per simulated second, and its calls.
"""

from __future__ import annotations

import statistics
from typing import Any

from protolearn.sim.costs import boundary_bytes_per_token
from protolearn.sim.swarm import Outcome


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "max": None, "n": 0}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1], "n": len(s)}


def build(out: Outcome, wall_s: float) -> dict[str, Any]:
    w = out.world
    m = w.metrics
    sc = w.scenario
    useful = m.useful_compute_s + m.useful_avg_s
    wasted = m.wasted_compute_s + m.wasted_avg_s + m.sync_s
    work = useful + wasted
    committed = sorted((r.committed_at, s) for s, r in m.steps.items() if r.committed_at is not None)
    gaps = [b[0] - a[0] for a, b in zip(committed, committed[1:])]
    first = committed[0][0] if committed else out.duration_s
    n_steps = len(committed)
    training_s = max(1e-9, out.duration_s - first)
    tokens = m.committed_tokens
    per_token = max(1, tokens)
    stages = sc.run.stages.num_stages
    empty = sum(
        max(m.empty_s.get(s - 1, 0.0) if s > 0 else 0.0, m.empty_s.get(s + 1, 0.0) if s < stages - 1 else 0.0) for s in range(stages)
    ) / max(1, stages) / out.duration_s
    denominator = max(1, n_steps)
    return {
        "scenario": sc.name,
        "nodes": sc.swarm.nodes,
        "stages": stages,
        "sim_s": out.duration_s,
        "wall_s": round(wall_s, 2),
        "events": out.events,
        "goodput": useful / work if work > 0 else None,
        "node_time_goodput": useful / m.node_s if m.node_s > 0 else None,
        "busy_share": work / m.node_s if m.node_s > 0 else None,
        # Where the work that ended up in no committed step went, as shares of all work (1 - goodput in all).
        "lost": {
            "redone_or_dropped_compute": m.wasted_compute_s / work if work > 0 else None,
            "failed_or_superseded_rounds": m.wasted_avg_s / work if work > 0 else None,
            "state_downloads": m.sync_s / work if work > 0 else None,
        },
        "useful_compute_s": m.useful_compute_s,
        "wasted_compute_s": m.wasted_compute_s,
        "useful_avg_s": m.useful_avg_s,
        "wasted_avg_s": m.wasted_avg_s,
        "sync_s": m.sync_s,
        "node_s": m.node_s,
        "steps": n_steps,
        "step_s": statistics.median(gaps) if gaps else None,
        "tokens_per_s": tokens / training_s if n_steps else 0.0,
        "tokens_per_step": sc.run.batch.microbatches_per_step * w.costs.tokens_per_microbatch,
        "boundary_bytes_per_token": [round((m.fwd_bytes[s] + m.bwd_bytes[s]) / per_token, 1) for s in range(stages - 1)],
        "codec_bytes_per_token": [round(boundary_bytes_per_token(sc.run, "fwd"), 1), round(boundary_bytes_per_token(sc.run, "bwd"), 1)],
        "sync_bytes_per_token": m.sync_bytes / per_token,
        "round_failures_per_step": sum(r.round_failures for r in m.steps.values()) / denominator,
        "exclusions_per_step": sum(r.round_exclusions for r in m.steps.values()) / denominator,
        "reopens_per_step": sum(r.reopened for r in m.steps.values()) / denominator,
        "redone_tickets_per_step": sum(r.redone_tickets for r in m.steps.values()) / denominator,
        "recover_s": _quantiles(m.recoveries),
        "detect_s": _quantiles(m.detections),
        "empty_neighbour_share": empty,
        "coordinator_cpu_per_s": w.host.cpu_s / out.duration_s,
        "coordinator_calls": w.host.calls,
        "arrivals": m.arrivals,
        "departures": dict(m.departures),
        "round_sizes": {str(k): v for k, v in sorted(m.round_sizes.items())},
        "node_events": {k: v for k, v in sorted(m.events.items())},
    }


def lines(report: dict[str, Any]) -> list[str]:
    """The report for a person: the headline numbers first."""
    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    r = report
    return [
        f"scenario {r['scenario']}: {r['nodes']} nodes, {r['stages']} stages, {r['sim_s'] / 3600:.2f} h simulated in {r['wall_s']:.1f} s "
        f"({r['events']:,} events)",
        f"goodput {f(r['goodput'])} (of node-time: {f(r['node_time_goodput'])}, busy {f(r['busy_share'])})",
        f"work lost to: redone or dropped compute {f(r['lost']['redone_or_dropped_compute'])}, failed or superseded rounds "
        f"{f(r['lost']['failed_or_superseded_rounds'])}, state downloads (joins, resyncs) {f(r['lost']['state_downloads'])}",
        f"steps {r['steps']}, step {f(r['step_s'], '.1f')} s, {f(r['tokens_per_s'], ',.0f')} tokens/s",
        f"bytes/token per boundary {r['boundary_bytes_per_token']} (codec fwd/bwd {r['codec_bytes_per_token']}), "
        f"replica sync {f(r['sync_bytes_per_token'], ',.1f')}",
        f"per step: round failures {f(r['round_failures_per_step'], '.2f')}, left out {f(r['exclusions_per_step'], '.2f')}, "
        f"reopens {f(r['reopens_per_step'], '.2f')}, redone tickets {f(r['redone_tickets_per_step'], '.1f')}",
        f"recover_s p50 {f(r['recover_s']['p50'], '.1f')} p90 {f(r['recover_s']['p90'], '.1f')} (n={r['recover_s']['n']}), "
        f"detect_s p50 {f(r['detect_s']['p50'], '.1f')}",
        f"waiting on an empty neighbour {f(r['empty_neighbour_share'])}, coordinator CPU {f(r['coordinator_cpu_per_s'], '.4f')} s/s",
    ]
