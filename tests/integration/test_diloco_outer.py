"""DiLoCo's outer rounds on real loopback hosts: the coordinator service decides, the replicas average over libp2p.

A real coordinator (``coordinator/service.py``) serves a DiLoCo run; four real hosts join (two replicas per
stage) and complete the round's inner steps through it (leases, signed acks, the commit barrier), routing
3 of each step's 4 tickets through one stage-1 replica. Each replica's stage worker then holds parameters of
its own (as its inner steps would leave them), and its :class:`~protolearn.node.outer_sync.OuterSync` runs
the outer round: the long poll of the decision, the pseudo-gradients through the real collective, the
Nesterov step. Checked: every replica of a stage ends bit-identical, on the token-weighted (3:1, from the
coordinator's records) mean of the pseudo-gradients; and a replica that arrives after the grace, in a run
whose quorum is one, is left out (it resyncs) while the other goes ahead alone. Run with ``[sync] compression``
``none`` (exact) and ``int8`` (the pseudo-gradients go through the same replica sync as a step's gradients:
the replicas still end bit-identical, near the exact mean, and the follower takes the proven int8 round), and
``powersgd:2`` (two rounds per outer round, the follower takes both; only agreement is checked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.service import serve
from protolearn.node.averaging import Averager
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
from protolearn.node.core.closed_step import CoreConfig
from protolearn.node.core.events import OuterDone, SyncOuter
from protolearn.node.core.inner_step import INNER_RESULT, InnerStepCore
from protolearn.node.outer_sync import OuterSync
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.replica_hashes import ReplicaHashes
from protolearn.node.replica_sync import ReplicaSync
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.stages.outer import nesterov_step
from tests.support.runs import tiny_run
from tests.support.waiting import wait_until

H, B = 2, 4
FAST = CoordinatorSettings(heartbeat_interval_s=0.2, expiry_s=5.0, lease_s=5.0, housekeeping_interval_s=0.05, rate_per_s=1000, rate_burst=1000)
RETRY = RetryPolicy(retry_for_s=10.0, request_timeout_s=10.0)


def _run(quorum: int, grace_s: float, compression: str = "none"):
    return tiny_run((2, 2), batch={"microbatches_per_step": B},
                    sync={"mode": "diloco", "inner_steps": H, "quorum": quorum, "grace_s": grace_s, "outer_lr": 0.7, "outer_momentum": 0.9,
                          "compression": compression})


class Replica:
    """One joined host with its stage worker, heartbeat and outer-round adapter."""

    def __init__(self, run, host, link: CoordinatorLink, stage: int, tmp: Path) -> None:
        self.host, self.link, self.stage = host, link, stage
        self.worker = StageWorker(run, stage)
        self.progress = Progress(tmp / f"{host.peer_id[-6:]}.jsonl", name=host.peer_id[-6:], live=False)
        self.core = InnerStepCore(host.peer_id, stage, CoreConfig(B, B, B, 30.0), inner_steps=H, steps=run.steps)
        self.hashes = ReplicaHashes(link, self.progress, host.peer_id, applied=lambda: self.worker.outer.anchor_applied)
        self.averager = Averager(host, stage, self.worker.numel, timeout_s=20.0, window=lambda: self.core.next_round)
        self.averager.register()
        config = NodeConfig(coordinator=link.addr, data_dir=tmp / host.peer_id[-6:], checkpoint_every=0)
        self.replica_sync = ReplicaSync(self.averager, run.sync.compression_spec, [tuple(p.shape) for p in self.worker.params], seed=run.seed)
        self.sync = OuterSync(self.core, self.worker, self.replica_sync, link, trio.CapacityLimiter(1), self.progress, hashes=self.hashes,
                              persistence=StagePersistence(config, run, self.progress, trio.CapacityLimiter(1)), target_steps=run.steps,
                              ask_timeout_s=20.0)

    def heartbeat(self) -> cm.Heartbeat:
        o = self.worker.outer
        return cm.Heartbeat(state="training", stage=self.stage, step=o.anchor_applied - 1, param_hash=self.hashes.latest(o.anchor_applied),
                            recent=self.hashes.recent(o.anchor_applied))

    def drift(self, seed: int) -> torch.Tensor:
        """Move the parameters as inner steps would; returns the pseudo-gradient (anchor - theta)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.worker.params:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        return self.worker.pseudo_gradient()


async def _steps(run, reps: dict[int, list[Replica]], steps: range) -> None:
    """Complete and commit ``steps``: stage-0 replica 0 leases every ticket; tickets 0-2 go through stage-1 replica 0."""
    s0, s1 = reps[0], reps[1]
    for step in steps:
        done = 0
        while done < B:
            lease = await s0[0].link.lease(B)
            for idx, nonce in zip(lease.indices, lease.nonces, strict=True):
                last = s1[0] if idx < 3 else s1[1]
                route = [s0[0].host.peer_id, last.host.peer_id]
                ack = last.host.sign(ack_statement(run.run_hash(), step, idx, route, 2.0, nonce))
                await s0[0].link.complete(step, idx, route, 2.0, ack, nonce)
                done += 1
        info = await s0[0].link.wait_step(step, timeout_s=10.0)
        assert info.closed
        for r in s0 + s1:
            await r.link.averaged(step, info.revision, INNER_RESULT)
        assert (await s0[0].link.wait_step(step, timeout_s=10.0, until="committed")).committed


@pytest.mark.parametrize("compression", ["none", "int8", "powersgd:2"])
def test_replicas_average_pseudo_gradients_by_recorded_tokens_and_a_late_one_is_left_out(open_hosts, run_trio, tmp_path, compression) -> None:
    run = _run(quorum=1, grace_s=1.0, compression=compression)
    # int8: one power-of-two scale per 64 values, drifts of ~1e-2: each value within ~1e-4, times lr * (1 + mu).
    # powersgd:2: a rank-2 approximation of random drifts is far from them; only the replicas' agreement is checked.
    tol = {"rtol": 1e-5, "atol": 1e-6} if compression == "none" else {"rtol": 0.0, "atol": 1e-3}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            coord = await nursery.start(lambda task_status: serve(run, tmp_path / "coord", settings=FAST, task_status=task_status))
            async with open_hosts(4, introduce=True) as hosts:
                reps: dict[int, list[Replica]] = {0: [], 1: []}
                async with trio.open_nursery() as beats:
                    for k, h in enumerate(hosts):
                        link = CoordinatorLink(h, coord.addrs[0], retry=RETRY)
                        joined = await link.join(cm.Join(addrs=[a.rsplit("/p2p/", 1)[0] for a in h.addrs()], throughput=100.0))
                        r = Replica(run, h, link, joined.stage, tmp_path)
                        reps[joined.stage].append(r)
                        await beats.start(r.link.heartbeat_loop, r.heartbeat)
                        # Placed by the replicas already working: the next one joins once this one counts.
                        await wait_until(lambda k=k: sum(coord.core.registry.working_counts()) == k + 1, "the replica to be working", 10.0)
                    assert [len(reps[0]), len(reps[1])] == [2, 2]
                    everyone = reps[0] + reps[1]
                    await _steps(run, reps, range(H))

                    # Round 1: everyone arrives. Stage 1's replica 0 processed 3 of each step's 4 tickets.
                    deltas = {r.host.peer_id: r.drift(k) for k, r in enumerate(everyone)}
                    anchors = {s: reps[s][0].worker.outer.anchor.clone() for s in (0, 1)}
                    done: dict[str, OuterDone] = {}

                    async def sync(r: Replica, round_: int, delay: float = 0.0) -> None:
                        await trio.sleep(delay)  # only round 2's late replica: it arrives well after the grace
                        done[r.host.peer_id] = await r.sync.sync(SyncOuter(round_ * H - 1, round_))

                    async with trio.open_nursery() as n:
                        for r in everyone:
                            n.start_soon(sync, r, 1)
                    for s in (0, 1):
                        a, b = reps[s]
                        assert not done[a.host.peer_id].resync and not done[b.host.peer_id].resync
                        assert a.worker.state_hash() == b.worker.state_hash() == done[a.host.peer_id].param_hash
                        weights = (3.0, 1.0) if s == 1 else (8.0, 0.0)  # stage 0: replica 0 leased every ticket
                        if weights[1]:
                            avg = (deltas[a.host.peer_id] * weights[0] + deltas[b.host.peer_id] * weights[1]) / sum(weights)
                        else:  # the other replica processed nothing: it followed (fetched the mean)
                            avg = deltas[a.host.peer_id]
                        want, _ = nesterov_step(anchors[s], torch.zeros_like(anchors[s]), avg, lr=0.7, mu=0.9)
                        if not compression.startswith("powersgd"):
                            torch.testing.assert_close(a.worker.outer.anchor, want, **tol)
                        if compression != "none" and weights[1]:
                            assert not torch.equal(a.worker.outer.anchor, want)  # it really went through int8
                    decided = coord.core.outer.last(1)
                    assert decided.weights == {reps[1][0].host.peer_id: 3 * H * 48.0, reps[1][1].host.peer_id: H * 48.0}

                    # Round 2: stage 1's replica 1 arrives well after the grace; with quorum 1 the round does not wait.
                    for r in everyone:
                        r.link.beat_now()
                    await _steps(run, reps, range(H, 2 * H))
                    for k, r in enumerate(everyone):
                        r.drift(100 + k)
                    done.clear()
                    late = reps[1][1]
                    async with trio.open_nursery() as n:
                        for r in everyone:
                            n.start_soon(sync, r, 2, 3.0 if r is late else 0.0)
                    assert done[late.host.peer_id].resync and "left out" in done[late.host.peer_id].reason
                    assert not done[reps[1][0].host.peer_id].resync
                    assert late.host.peer_id in coord.core.outer.last(1).left_out
                    beats.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=120)
