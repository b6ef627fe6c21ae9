"""Spot checks over real hosts (node/integrity.py): a stage-1 receiver has stage-0 replicas recompute what
one of them sent, and sends the coordinator evidence it can verify itself (protocol/boundary.py).

Four hosts on loopback: three stage-0 replicas A, B, D with identical weights, and a stage-1 checker R.
No coordinator runs here: R's report callable captures what it would send, and the test verifies the
evidence with the coordinator's own check (:func:`~protolearn.protocol.boundary.verify_evidence`).
"""

from __future__ import annotations

import torch
import trio
from protolearn.node.integrity import Integrity, Received
from protolearn.node.worker import StageWorker
from protolearn.protocol.boundary import boundary_statement, frame_digest, verify_evidence
from protolearn.protocol.codecs import make_encoder
from protolearn.protocol.frames import TensorLimits
from protolearn.protocol.identity import verify_peer
from protolearn.protocol.pipeline import CHECK, CheckRequest, Refuse
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import load_corpus
from protolearn.stages.sampling import microbatch

RUN = RunConfig.model_validate({
    "name": "checks", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16}, "data": {"max_bytes": 100_000},
    "integrity": {"spot_check_rate": 1.0},
})
SHAPE = [2, 16, 32]


def _integrity(host, worker, corpus, stages: dict[str, int], reports: list) -> Integrity:
    async def report(accused, reason, ev, fault):
        reports.append((accused, reason, ev))
        return False

    return Integrity(
        host, RUN, worker, corpus, trio.CapacityLimiter(1), replicas=lambda s: sorted(p for p, st in stages.items() if st == s),
        stage_of=stages.get, report=report, timeout_s=10.0, seed=7,
    )


def _sent(a_host, tensor: torch.Tensor, step: int, ticket: int) -> tuple:
    frame, _ = make_encoder("none").encode(tensor)
    signature = a_host.sign(boundary_statement(RUN.run_hash(), step, ticket, "fwd", 0, b"", frame_digest(frame)))
    return frame, signature


def test_a_lying_replica_is_caught_by_two_recomputations_and_an_honest_one_passes(open_hosts, run_trio) -> None:
    corpus = load_corpus(RUN.data)

    async def main() -> None:
        async with open_hosts(4) as (a, b, d, r):
            stages = {a.peer_id: 0, b.peer_id: 0, d.peer_id: 0, r.peer_id: 1}
            reports: list = []
            async with trio.open_nursery() as nursery:
                for host in (b, d):  # the replicas that recompute
                    _integrity(host, StageWorker(RUN, 0), corpus, stages, []).register(nursery)
                checker = _integrity(r, StageWorker(RUN, 1), corpus, stages, reports)
                checker.register(nursery)
                checker.monitor = None  # this test is about spot checks alone
                honest = StageWorker(RUN, 0).forward((0, 1), microbatch(RUN, corpus, 0, 1)[0])

                # An honest output passes: one recomputation agrees.
                frame, sig = _sent(a, honest, 0, 1)
                checker.observe(Received(a.peer_id, 0, "fwd", 0, 1, b"", frame, sig, honest))
                with trio.fail_after(20):
                    while checker.stats.checks_passed < 1:
                        await trio.sleep(0.05)
                assert not reports and checker.per_peer[a.peer_id] == [1, 0]

                # A flipped output: both recomputations disagree with it, so the evidence convicts A.
                lie = -honest
                frame, sig = _sent(a, lie, 0, 1)
                checker.observe(Received(a.peer_id, 0, "fwd", 0, 1, b"", frame, sig, lie))
                with trio.fail_after(20):
                    while not reports:
                        await trio.sleep(0.05)
                accused, _, ev = reports[0]
                assert accused == a.peer_id and ev is not None and len(ev.outputs) == 3
                why = verify_evidence(ev, run_hash=RUN.run_hash(), codec="none", check_tolerance=1e-3, shape=SHAPE,
                                      verify=verify_peer, limits=TensorLimits(max_elements=2048, max_bytes=65536))
                assert "2 other replicas" in why and checker.per_peer[a.peer_id] == [1, 1]
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=90)


def test_a_replica_recomputes_only_for_a_neighbouring_stage_and_at_its_own_weights(open_hosts, run_trio) -> None:
    corpus = load_corpus(RUN.data)

    async def main() -> None:
        async with open_hosts(3) as (b, r, stranger):
            stages = {b.peer_id: 0, r.peer_id: 1, stranger.peer_id: 0}
            async with trio.open_nursery() as nursery:
                _integrity(b, StageWorker(RUN, 0), corpus, stages, []).register(nursery)

                async def ask(host, **fields) -> Refuse:
                    async with host.open_stream(b.peer_id, CHECK) as s:
                        await s.send(CheckRequest(**{"step": 0, "ticket": 1, "stage": 0, "direction": "fwd", "inputs": 0, **fields}))
                        return await s.receive(Refuse)

                # A peer of its own stage does not receive its outputs: no recomputation for it.
                assert "member of stage 1" in (await ask(stranger)).reason
                # Weights for another step: refused rather than recomputed with the wrong ones.
                assert "not 3" in (await ask(r, step=3)).reason
                # Stage 0's forward takes no input tensors (the tokens follow from the run).
                assert "takes 0 input tensors" in (await ask(r, inputs=1)).reason
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)

