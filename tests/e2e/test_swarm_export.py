"""`protolearn swarm export` as a user runs it: fetch a live swarm's parameters into one model file.

A fault-free swarm with codec none equals the single-process reference trainer (I3), so the exported
model's validation loss (`protolearn evaluate`) must equal the reference's after the same number of
steps, and `train-local --init` must start from exactly that model.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import cli
from tests.support.swarm import Swarm, TINY

TIMEOUT_S = 120


def test_swarm_export_reproduces_the_reference_validation_loss(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    # Many more steps than the test waits for: the swarm is live (and moving) while it is exported.
    config.write_text(TINY.format(steps=500, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    out = tmp_path / "model.safetensors"
    try:
        addr = s.start_coordinator()
        names = ["n0", "n1"]
        for n in names:
            s.start_node(n, addr, "--checkpoint-every", "0")
        s.wait_alive("both nodes to apply 3 steps", lambda: all(len(s.events(m, "step")) >= 3 for m in names), TIMEOUT_S, *names)
        r = cli("swarm", "export", "--coordinator", addr, "--out", str(out), "--json", "--timeout", "60")
    finally:
        s.stop()
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    step = summary["step"]
    assert step >= 3 and summary["run"] == "tiny" and Path(summary["config"]) == tmp_path / "model.toml"

    ev = cli("evaluate", "--model", str(out), "--json", "--threads", "1")
    assert ev.returncode == 0, ev.stderr
    val = json.loads(ev.stdout)
    assert val["step"] == step

    ref = cli("train-local", "--config", str(config), "--steps", str(step), "--threads", "1", "--eval-every", "1000",
              "--log", str(tmp_path / "ref.jsonl"), "--json")
    assert ref.returncode == 0, ref.stderr
    ref_val = json.loads(ref.stdout)["final_val_loss"]
    assert abs(val["val_loss"] - ref_val) <= 1e-3 * ref_val, f"exported model val loss {val['val_loss']} vs reference {ref_val} after {step} steps"

    # train-local continues the exported model: it starts at the swarm's step, from exactly these weights.
    cont = cli("train-local", "--init", str(out), "--steps", "1", "--threads", "1", "--log", str(tmp_path / "cont.jsonl"), "--json")
    assert cont.returncode == 0, cont.stderr
    c = json.loads(cont.stdout)
    assert c["start_step"] == step and c["initial_val_loss"] == val["val_loss"]


def test_swarm_export_from_an_unreachable_coordinator_is_one_line(tmp_path: Path) -> None:
    addr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"
    r = cli("swarm", "export", "--coordinator", addr, "--out", str(tmp_path / "m.safetensors"), "--timeout", "5")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot get the membership from the coordinator")
    assert not (tmp_path / "m.safetensors").exists()


def test_swarm_export_works_after_the_run_finished_and_every_node_left(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    steps = 4
    config.write_text(TINY.format(steps=steps, codec="none", layers=2, stages=2))
    s = Swarm(tmp_path, config)
    out = tmp_path / "final.safetensors"
    try:
        addr = s.start_coordinator()
        names = ["n0", "n1"]
        for n in names:
            s.start_node(n, addr, "--checkpoint-every", "0")
        s.wait_nodes(names, 240)  # the run ends; the nodes stay until the coordinator kept the model, then leave
        st = json.loads(cli("swarm", "status", "--coordinator", addr, "--json", timeout=TIMEOUT_S).stdout)
        assert st["verdict"] == "finished" and st["nodes"] == [] and st["final_step"] == steps, st["verdict_reason"]
        r = cli("swarm", "export", "--coordinator", addr, "--out", str(out), "--json", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["step"] == steps
        gen = cli("generate", "--coordinator", addr, "--prompt", "def ", "--tokens", "16", timeout=TIMEOUT_S)
        assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
    finally:
        s.stop()
    # The model the coordinator kept is the swarm's after its last step: the reference's, as for a live export.
    ev = cli("evaluate", "--model", str(out), "--json", "--threads", "1")
    ref = cli("train-local", "--config", str(config), "--steps", str(steps), "--threads", "1", "--eval-every", "1000",
              "--log", str(tmp_path / "ref.jsonl"), "--json")
    assert ev.returncode == 0 and ref.returncode == 0, ev.stderr + ref.stderr
    val, ref_val = json.loads(ev.stdout)["val_loss"], json.loads(ref.stdout)["final_val_loss"]
    assert abs(val - ref_val) <= 1e-3 * ref_val, (val, ref_val)
