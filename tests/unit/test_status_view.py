"""``swarm status`` as a person reads it: at 80 columns nothing is cut, names show, and the verdicts are right.

The status comes from the real coordinator core (joins, heartbeats, closed and committed steps), and is
drawn with a rich Console of a fixed width, as a terminal of that width would show it.
"""

from __future__ import annotations

import jsonschema
import pytest
from rich.console import Console

from protolearn.cli.status_view import WIDE_COLUMNS, chart, health, render
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.outer_rounds import OuterSpec
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.status import STATUS_JSON_SCHEMA
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.status_schema import NodeView, Status

SETTINGS = CoordinatorSettings(rate_per_s=1e9, rate_burst=1e9, heartbeat_interval_s=1.0, expiry_s=1e6)
NAMES = ["gpu-box-1", "gpu-box-2", "laptop", "workstation-7"]
PEERS = [f"12D3KooW{'ABCDEFGH'[k] * 44}" for k in range(4)]


def _sign(peer: str, data: bytes) -> bytes:
    return f"{peer}:{len(data)}".encode()


def _verify(peer: str, data: bytes, signature: bytes) -> bool:
    return signature == _sign(peer, data)


def swarm(steps: int = 40, closed: int = 12, *, replicas_per_stage: int = 2, outer: OuterSpec | None = None) -> tuple[CoordinatorCore, float]:
    """Two stages, named nodes, ``closed`` steps closed and committed with a falling loss; returns (core, now)."""
    run = RunInfo(name="demo", run_hash="a" * 64, run_toml="", layers=(2, 2), microbatches_per_step=2, tokens_per_step=2048, steps=steps,
                  outer=outer)
    core = CoordinatorCore(run, SETTINGS, peer_id="12D3KooWcoordinatorcoordinatorcoordinatorcoordi", started_at=0.0, verify=_verify)
    members = list(zip(PEERS, NAMES, strict=True))[: 2 * replicas_per_stage]
    stage_of = {}
    for peer, name in members:
        stage_of[peer] = core.handle(peer, cm.Join(addrs=["/ip4/10.0.0.1/tcp/1"], throughput=1500.0, name=name), 0.0).stage
    s0 = [p for p, _ in members if stage_of[p] == 0]
    s1 = [p for p, _ in members if stage_of[p] == 1]
    now = 1.0
    for step in range(closed):
        for i in range(2):
            route = [s0[i % len(s0)], s1[i % len(s1)]]
            loss = 5.5 - 3.0 * step / max(1, closed)
            lease = core.handle(route[0], cm.Lease(max_tickets=1), now)
            ack = _sign(route[-1], ack_statement(run.run_hash, step, i, route, loss, lease.nonces[0]))
            core.handle(route[0], cm.Complete(step=step, index=i, route=route, loss=loss, ack=ack, nonce=lease.nonces[0]), now)
        for peer, _ in members:
            core.handle(peer, cm.Averaged(step=step, revision=1, result_hash="r"), now)
        now += 2.0
        for peer, _ in members:
            # In DiLoCo mode a replica reports its state after the last outer sync: none in these first steps.
            reported = {"step": step, "param_hash": f"h{stage_of[peer]}-{step}"} if outer is None else {"inner_step": step}
            core.handle(peer, cm.Heartbeat(state="training", throughput=1500.0, stage=stage_of[peer], **reported), now)
    return core, now


def draw(st: Status, width: int, **kw: object) -> list[str]:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console.print(render(st, **kw))  # type: ignore[arg-type]
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 120])
def test_status_fits_the_terminal_with_no_cut_header_or_cell_and_shows_names(width: int) -> None:
    core, now = swarm()
    st = core.handle("reader", cm.StatusRequest(), now)
    lines = draw(st, width)
    text = "\n".join(lines)
    print(text)
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert "…" not in text.replace(f"…{st.coordinator[-8:]}", ""), "a header or a cell was cut"
    header = next(line for line in lines if "name" in line and "health" in line)
    for col in ("name", "stage", "state", "step", "tok/s", "health"):
        assert col in header
    for name in NAMES:
        row = next(line for line in lines if line.lstrip().startswith(name))
        assert " ok" in row and "training" in row, row  # one line per node, with its health word
    assert "step 12 of 40" in text and "ETA" in text
    assert "▁=2." in text and "█=5.50" in text and "steps 0-11" in text  # the loss chart says its scale
    assert "HEALTHY" in text


def test_a_wide_terminal_or_wide_shows_every_column() -> None:
    core, now = swarm()
    st = core.handle("reader", cm.StatusRequest(), now)
    lines = draw(st, WIDE_COLUMNS)
    header = next(line for line in lines if "name" in line and "peer" in line)
    for col in ("reach", "path", "flags", "integrity", "last seen"):
        assert col in header, header
    # The only ellipses are the short peer IDs (…<last 8>), one per node, and the coordinator's in the header.
    assert all(len(line) <= WIDE_COLUMNS for line in lines) and "\n".join(lines).count("…") == len(st.nodes) + 1
    # --wide on a narrow terminal: the cells wrap, nothing is cut off.
    narrow = draw(st, 80, wide=True)
    assert all(len(line) <= 80 for line in narrow) and "\n".join(narrow).count("…") == len(st.nodes) + 1


def test_names_are_in_the_json_and_it_matches_schema_4() -> None:
    core, now = swarm()
    st = core.handle("reader", cm.StatusRequest(), now)
    doc = st.model_dump(mode="json")
    jsonschema.validate(doc, STATUS_JSON_SCHEMA)
    assert doc["schema_version"] == 5 and doc["run"]["steps"] == 40
    assert sorted(n["name"] for n in doc["nodes"]) == sorted(NAMES)
    assert doc["eta_s"] is not None and doc["eta_s"] > 0 and doc["at_risk"] == []


def test_a_stage_with_a_single_replica_is_at_risk_not_healthy() -> None:
    core, now = swarm(replicas_per_stage=1)
    st = core.handle("reader", cm.StatusRequest(), now)
    assert st.at_risk == [0, 1]
    text = "\n".join(draw(st, 80))
    assert "AT RISK" in text and "HEALTHY" not in text and "single replica" in text


def test_a_finished_run_says_finished_not_halted_even_after_every_node_left() -> None:
    core, now = swarm(steps=12, closed=12)
    for peer in PEERS:
        core.handle(peer, cm.Leave(reason="finished"), now)
    st = core.handle("reader", cm.StatusRequest(), now)
    assert st.verdict == "finished" and "all 12 steps done" in st.verdict_reason and st.eta_s is None
    text = "\n".join(draw(st, 80))
    assert "FINISHED" in text and "HALTED" not in text and "step 12 of 12" in text
    jsonschema.validate(st.model_dump(mode="json"), STATUS_JSON_SCHEMA)


def test_before_any_step_closed_the_view_says_so_plainly() -> None:
    core, now = swarm(closed=0)
    st = core.handle("reader", cm.StatusRequest(), now)
    text = "\n".join(draw(st, 80))
    assert "step 0 of 40 (none closed yet)" in text and "last closed -1" not in text
    stages = [line for line in text.splitlines() if line.lstrip()[:1] in ("0", "1") and "replicas" not in line]
    assert stages and all("agree" not in line for line in stages), stages  # no hashes yet: not "agree"


def test_the_loss_chart_keeps_one_scale_over_the_whole_history() -> None:
    falling = [5.0 - 0.1 * i for i in range(100)]
    bars = chart(falling)
    assert len(bars) == 32 and bars[0] == "█" and bars[-1] == "▁"
    assert list(bars) == sorted(bars, reverse=True)  # monotone: a falling loss reads as falling


def test_health_names_the_most_urgent_problem() -> None:
    base = NodeView(peer_id="p", stage=0, state="training", last_seen_s=0.1, throughput=1.0, queue_len=0, step=1, loss=None, flags=[])
    assert health(base) == "ok"
    assert health(base.model_copy(update={"flags": ["behind", "stale"]})) == "stale"
    assert health(base.model_copy(update={"flags": ["hash-mismatch"]})) == "mismatch"
    assert health(base.model_copy(update={"flags": ["redo_storm:2"]})) == "flagged"


def test_diloco_shows_the_mode_each_stages_last_outer_round_and_who_it_left_out_and_the_inner_steps() -> None:
    core, now = swarm(closed=4, outer=OuterSpec(inner_steps=4, steps=40, quorum=1, grace_s=1.0, tokens_per_ticket=1024))
    stage_of = {p: core.registry.members[p].stage for p in PEERS}
    late = next(p for p in PEERS if stage_of[p] == 1)
    for peer in PEERS:
        if peer != late:
            core.handle(peer, cm.OuterReady(stage=stage_of[peer], round=1, since_step=0), now)
    core.housekeeping(now + 1.5)  # stage 1's grace ran out without its late replica
    for peer in PEERS:
        core.handle(peer, cm.Heartbeat(state="training", throughput=1500.0, step=3, param_hash=f"a{stage_of[peer]}", stage=stage_of[peer],
                                       inner_step=3), now + 2)
    st = core.handle("reader", cm.StatusRequest(), now + 2)
    jsonschema.validate(st.model_dump(mode="json"), STATUS_JSON_SCHEMA)
    assert st.run.sync == "diloco" and st.run.inner_steps == 4
    assert [s.outer.round if s.outer else None for s in st.stages] == [1, 1]
    assert st.stages[1].outer is not None and [x.peer_id for x in st.stages[1].outer.left_out] == [late]
    lines = draw(st, 80)
    text = "\n".join(lines)
    print(text)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "DiLoCo H=4" in text and "synced@step" in text and "outer rounds" in text
    late_name = NAMES[PEERS.index(late)]
    row = next(line for line in lines if "step 3" in line and "late" in line)
    assert f"{late_name} (late)" in row and row.split()[:5] == ["1", "1", "step", "3", "1"], row
    assert "…" not in text.replace(f"…{st.coordinator[-8:]}", ""), "a header or a cell was cut"
    node_rows = [line for line in lines if line.lstrip().startswith(tuple(NAMES))]
    assert len(node_rows) == 4 and all(line.split()[3] == "3" for line in node_rows)  # each node's inner step
