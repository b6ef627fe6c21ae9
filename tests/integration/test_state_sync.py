"""State sync between real hosts: a joining replica downloads its stage from several replicas at once."""

from __future__ import annotations

import pytest
import torch

from protolearn.node.errors import StateSyncError
from protolearn.node.state_sync import StateServer, fetch_state, fetch_state_split
from protolearn.node.worker import StageWorker
from protolearn.stages.config import RunConfig

RUN = RunConfig.model_validate(
    {
        "name": "sync",
        "seed": 3,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 48, "max_seq_len": 32},
        "stages": {"num_stages": 2, "layers": [1, 1]},
        "batch": {"microbatches_per_step": 2, "microbatch_size": 3, "seq_len": 16},
    }
)


def _donor(applied: int, bump: float = 0.0) -> tuple[StageWorker, list[int]]:
    """A stage-1 replica after ``applied`` steps; ``served`` counts the snapshots it handed out."""
    w = StageWorker(RUN, 1)
    with torch.no_grad():
        for p in w.params:
            p.add_(0.01 * applied + bump)
    w.applied = applied  # type: ignore[attr-defined]  # the test's own record: a node keeps it in its core
    return w, []


def test_a_joiner_takes_one_share_from_each_replica_and_gets_the_whole_state(open_hosts, run_trio) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            donors = [_donor(7), _donor(7)]
            for host, (w, served) in zip(hosts[:2], donors, strict=True):

                async def snap(w=w, served=served):
                    served.append(1)
                    return w.applied, w.param_hash(), w.snapshot()

                StateServer(host, 1, RUN.run_hash(), snap).register()
            joiner = StageWorker(RUN, 1)
            applied, claimed, entries = await fetch_state_split(
                hosts[2], [h.peer_id for h in hosts[:2]], joiner, RUN.run_hash(), timeout_s=20.0
            )
            assert [len(s) for _, s in donors] == [1, 1]  # both replicas served a share
            assert applied == 7 and joiner.load(entries) == claimed == donors[0][0].param_hash()
            assert len(entries) == len(donors[0][0].snapshot())  # parameters and optimizer moments, all of them
            # A single donor still sends everything.
            _, alone, whole = await fetch_state(hosts[2], hosts[0].peer_id, joiner, RUN.run_hash(), timeout_s=20.0)
            assert alone == claimed and whole.keys() == entries.keys()

    run_trio(main, timeout=60)


def test_replicas_that_hold_different_states_are_not_mixed(open_hosts, run_trio) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host, (w, _) in zip(hosts[:2], [_donor(7), _donor(7, bump=0.5)], strict=True):

                async def snap(w=w):
                    return w.applied, w.param_hash(), w.snapshot()

                StateServer(host, 1, RUN.run_hash(), snap).register()
            with pytest.raises(StateSyncError, match="different states"):
                await fetch_state_split(hosts[2], [h.peer_id for h in hosts[:2]], StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0)

    run_trio(main, timeout=60)
