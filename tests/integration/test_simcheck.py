"""``scripts/bench_simcheck.py`` (the simulator against a real swarm) without its real swarm: its figures from a real
run's event logs, and the simulation that replays that run (a real ``scripts/simulate.py`` subprocess).

The event logs here are written by the test, in the node's format (``step``, ``step_times``, ``joined``, ``synced``,
``link``): the real swarm on 20 Mbit/s links takes about nine minutes (``python scripts/bench.py simcheck --json``,
docs/BENCHMARKS.md), too long for the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
LINK = "up=20mbit,down=100mbit,20ms"


def _bench():
    return load_script("bench_simcheck")


def _real_run(steps: int = 10) -> dict:
    from protolearn.cli.demo import demo_run_toml

    t0 = 1_800_000_000.0
    logs: dict[str, list[dict]] = {}
    for k in range(6):
        stage, tickets = k // 2, [0, 1] if k % 2 == 0 else [2, 3]
        events = [{"t": t0 + 1.0 + k * 0.1, "event": "joined", "stage": stage}, {"t": t0 + 1.2, "event": "built", "stage": stage}]
        if k == 5:  # the last to join downloads the state for half a second
            events.append({"t": t0 + 2.0, "event": "synced"})
        for step in range(steps):
            events.append({"t": t0 + 3 + 5 * step, "event": "step", "step": step, "tickets": tickets})
            events.append({"t": t0 + 3 + 5 * step, "event": "step_times", "step": step, "rounds": 1, "compute_s": 0.5 + 0.1 * stage,
                           "apply_s": 0.1, "averaging_s": 1.0})
        events.append({"t": t0 + 60, "event": "link", "up": {"bytes": 1_000_000}})
        logs[f"node{k}"] = events
    return {"run_toml": demo_run_toml(None, stages=3, steps=steps, codec="none"), "nodes_started_at": t0,
            "closes": [t0 + 2.9 + 5 * i for i in range(steps)], "crash_at": t0 + 21.0, "victim": "node0", "victim_stage": 0, "logs": logs}


def test_the_real_runs_figures_are_read_from_its_nodes_logs() -> None:
    from protolearn.sim.costs import RunCosts
    from protolearn.stages.config import RunConfig

    real = _real_run()
    f = _bench().real_figures(real)
    run = RunConfig.from_toml_text(real["run_toml"])
    assert f["steps"] == 10 and f["step_s"] == pytest.approx(5.0)
    # Every microbatch credited, so the only loss is node5's half-second download.
    compute = sum(10 * (0.4 + 0.1 * (k // 2)) for k in range(6))
    averaging = 6 * 10 * 1.0
    assert f["goodput"] == pytest.approx((compute + averaging) / (compute + averaging + 1.0 - 0.1 * 5))
    assert f["bytes_per_token"] == pytest.approx(6_000_000 / (10 * run.batch.tokens_per_step))
    # The calibration: the FLOPs of the microbatches after the warm-up over their compute seconds.
    costs = RunCosts.of(run)
    flops = sum(2 * (10 - 2) * (costs.stages[k // 2].fwd_flops + costs.stages[k // 2].bwd_flops) for k in range(6))  # 2 a step
    seconds = sum((10 - 2) * (0.4 + 0.1 * (k // 2)) for k in range(6))
    assert f["calibrated_tflops"] == pytest.approx(flops / seconds / 1e12)


def test_the_simulation_replays_the_real_runs_joins_and_crash_at_its_compute_speed(tmp_path: Path) -> None:
    bench = _bench()
    real = _real_run()
    f = bench.real_figures(real)
    sim = bench.sim_run(real, f["calibrated_tflops"], LINK, 0, tmp_path)
    lines = sim["trace"]
    assert sorted(line.split(",")[2] for line in lines if ",join," in line) == [f"node{k}" for k in range(6)]
    assert [line for line in lines if ",crash," in line] == ["21.000,crash,node0"]
    assert f"hardware.tflops={f['calibrated_tflops']:.6g}" in sim["command"] and "tflops_sigma=0" in sim["command"]
    assert sim["steps"] > 0 and 0 < sim["goodput"] <= 1 and sim["step_s"] > 0, sim
    # Bytes per token: both directions of both boundaries and the replica sync.
    assert sim["bytes_per_token"] == pytest.approx(sum(sim["boundary_bytes_per_token"]) + sim["sync_bytes_per_token"])


def test_bad_arguments_are_one_line() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "scripts/bench.py", "simcheck", "--crash-after", "9", "--join-after", "5"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "need 0 < --crash-after (9) < --join-after (5)" in out.stderr.strip().splitlines()[-1]


def test_a_node_that_moved_stages_counts_both_downloads_and_not_the_time_between() -> None:
    logs = [{"t": 10.0, "event": "joined"}, {"t": 12.0, "event": "synced"}, {"t": 200.0, "event": "moved"},
            {"t": 203.5, "event": "synced"}, {"t": 300.0, "event": "resync"}, {"t": 301.0, "event": "synced"}]
    assert _bench().state_download_s(logs) == pytest.approx(2.0 + 3.5 + 1.0)
