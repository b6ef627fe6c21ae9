"""A swarm export (and the final model the coordinator keeps, which it fetches the same way) takes no single
replica's word: the state a replica serves must hash to what a strict majority of its stage reported.

Real libp2p hosts on loopback: the replicas serve their state over the state-sync protocol; the coordinator is
a stand-in that answers the two requests an export makes (the membership and a stage's reported hashes) from
a fixed table, because a real coordinator would need a swarm that trains to have hashes to report.
"""

from __future__ import annotations

from pathlib import Path

import torch
from protolearn.node.export import load_model, write_model
from protolearn.node.model_server import ModelServer
from protolearn.node.state_sync import StateServer
from protolearn.node.swarm_export import export_swarm
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.wire import Message
from protolearn.protocol.states import NodeState
from protolearn.stages.stage import build_stage
from tests.support.runs import tiny_run

RUN = tiny_run((1, 1), name="export-trust")
APPLIED = 7


def _replica(stage: int, bump: float) -> StageWorker:
    """A replica of ``stage`` after APPLIED steps (its parameters moved by ``bump``, its moments set)."""
    w = StageWorker(RUN, stage)
    with torch.no_grad():
        for p in w.params:
            p.add_(bump)
            w.optimizer.state[p] = {"step": torch.tensor(float(APPLIED)), "exp_avg": torch.full_like(p, 0.1),
                                    "exp_avg_sq": torch.full_like(p, 0.01)}
    return w


def test_an_export_refuses_a_lying_replica_and_takes_the_stages_majority(open_hosts, run_trio, tmp_path: Path) -> None:
    """Stage 1 has three replicas, and the one an export tries first (the lowest peer ID) lies: it serves
    another state and reported its hash. Before this check the export took that replica's state."""
    async def main() -> None:
        async with open_hosts(6) as hosts:
            coord, exporter, donors = hosts[0], hosts[1], hosts[2:]
            # Stage 1's replicas, in the order an export tries them (by peer ID): the liar first.
            stage1 = sorted(donors[1:], key=lambda h: h.peer_id)
            workers = {donors[0].peer_id: _replica(0, 0.01)}
            for k, h in enumerate(stage1):
                workers[h.peer_id] = _replica(1, 0.5 if k == 0 else 0.01)
            for h in donors:
                w = workers[h.peer_id]

                async def snap(w=w):
                    return w.shared_snapshot(lambda: APPLIED, False)

                StateServer(h, w.stage, RUN.run_hash(), snap).register()
            members = [cm.MemberView(peer_id=h.peer_id, stage=workers[h.peer_id].stage, addrs=h.addrs(), state=NodeState.TRAINING,
                                     throughput=1.0, queue_len=0) for h in donors]
            # Every replica reported the hash of the state it serves, after step APPLIED - 1.
            reported = {s: [cm.ParamHash(peer_id=h.peer_id, step=APPLIED - 1, hash=workers[h.peer_id].state_hash())
                            for h in donors if workers[h.peer_id].stage == s] for s in (0, 1)}

            async def answer(peer: str, msg: Message) -> Message:
                if isinstance(msg, cm.MembersRequest):
                    return cm.Members(run_toml=RUN.to_toml(), run_hash=RUN.run_hash(), step=APPLIED, members=members)
                assert isinstance(msg, cm.StageHashesRequest)
                return cm.StageHashes(stage=msg.stage, step=APPLIED, param_hashes=reported[msg.stage])

            coord.serve(cm.COORDINATOR, answer, request_type=(cm.MembersRequest, cm.StageHashesRequest))
            out = tmp_path / "model.safetensors"
            result = await export_swarm(exporter, coord.addrs()[0], out, timeout_s=30.0)
            assert result.step == APPLIED
            stages = [build_stage(RUN, s) for s in (0, 1)]
            load_model(out, stages)
            honest, liar = workers[stage1[-1].peer_id], workers[stage1[0].peer_id]
            assert stages[1].state_hash() == honest.module.state_hash() != liar.module.state_hash()
            assert stages[0].state_hash() == workers[donors[0].peer_id].module.state_hash()

    run_trio(main, timeout=90)


def test_an_export_of_the_kept_final_model_takes_every_stage_of_a_deep_model(open_hosts, run_trio, tmp_path: Path) -> None:
    """After a run every node left, and the coordinator serves the final model it kept, every stage from one
    peer: the export asks it for one stage at a time, within what one peer may open on its state streams."""
    run = tiny_run((1,) * 6, name="kept-final")
    stages = [build_stage(run, s) for s in range(6)]
    with torch.no_grad():
        for m in stages:
            for p in m.parameters():
                p.add_(0.25)
    saved = tmp_path / "final" / "model.safetensors"
    saved.parent.mkdir()
    write_model({n: p for m in stages for n, p in m.named_parameters()}, run, 9, saved)

    async def main() -> None:
        async with open_hosts(2) as (coord, exporter):

            async def answer(peer: str, msg: Message) -> Message:
                assert isinstance(msg, cm.MembersRequest)
                return cm.Members(run_toml=run.to_toml(), run_hash=run.run_hash(), step=9, members=[], final_step=9)

            coord.serve(cm.COORDINATOR, answer, request_type=(cm.MembersRequest,))
            ModelServer(coord, saved).register()
            out = tmp_path / "model.safetensors"
            result = await export_swarm(exporter, coord.addrs()[0], out, timeout_s=30.0)
            assert result.step == 9
            back = [build_stage(run, s) for s in range(6)]
            load_model(out, back)
            assert [m.state_hash() for m in back] == [m.state_hash() for m in stages]

    run_trio(main, timeout=90)
