"""Spot checks over real hosts (node/integrity.py): a stage-1 receiver has stage-0 replicas recompute what
one of them sent, and sends the coordinator evidence it can verify itself (protocol/boundary.py).

Four hosts on loopback: three stage-0 replicas A, B, D with identical weights, and a stage-1 checker R.
No coordinator runs here: R's report callable captures what it would send, its witness draw names every
other replica of the checked stage (what the coordinator's draw is with two eligible replicas,
coordinator/core/witnesses.py), and the test verifies the evidence with the coordinator's own check
(:func:`~protolearn.protocol.boundary.verify_evidence`).
"""

from __future__ import annotations

import pytest
import torch
import trio
from protolearn.node.core.tickets import Tickets
from protolearn.node.integrity import Integrity, Received
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.node.worker import StageWorker
from protolearn.protocol.boundary import boundary_statement, frame_digest, verify_evidence
from protolearn.protocol.codecs import CodecContext, make_encoder
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
# The same run with the subspace codec: frames carry 4 fp16 coefficients per token and the token ids.
SUBSPACE_RUN = RUN.replace(**{"codec": "subspace", "subspace.rank": 4})
# The same run admitting bf16: every recomputation comes in float32 and in bf16, both signed (protolearn/precision.py).
BF16_RUN = RUN.replace(**{"integrity.precisions": ("fp32", "bf16")})


class _LyingChecks(Outbound):
    """A witness that flips every recomputation it serves (and nothing it sends on the pipeline)."""

    def tensor(self, t, step, ticket, direction, *, check=False):
        return -t if check else t


def _integrity(host, worker, corpus, stages: dict[str, int], reports: list, run: RunConfig = RUN, outbound: Outbound = PASS_THROUGH,
               first_pick: list[str] | None = None) -> Integrity:
    async def report(accused, reason, ev, fault):
        reports.append((accused, reason, ev))
        return False

    async def witnesses(target, step, ticket, direction):
        return sorted(p for p, st in stages.items() if st == stages[target] and p != target)

    return Integrity(
        host, run, worker, corpus, trio.CapacityLimiter(1), tickets=Tickets(), witnesses=witnesses,
        replicas=lambda s: first_pick if first_pick is not None else sorted(p for p, st in stages.items() if st == s),
        stage_of=stages.get, report=report, timeout_s=10.0, seed=7, outbound=outbound,
    )


def _sent(a_host, tensor: torch.Tensor, step: int, ticket: int, run: RunConfig = RUN, tokens: torch.Tensor | None = None) -> tuple:
    sub = StageWorker(run, 0).module.subspace if run.subspace.rank else None
    frame, _ = make_encoder(run.codec).encode(tensor, context=CodecContext(sub, "fwd", tokens))
    signature = a_host.sign(boundary_statement(run.run_hash(), step, ticket, "fwd", 0, b"", frame_digest(frame)))
    return frame, signature


@pytest.mark.parametrize("run", [RUN, SUBSPACE_RUN, BF16_RUN], ids=["none", "subspace", "bf16"])
def test_a_lying_replica_is_caught_by_two_recomputations_and_an_honest_one_passes(open_hosts, run_trio, run: RunConfig) -> None:
    corpus = load_corpus(run.data)

    async def main() -> None:
        async with open_hosts(4) as (a, b, d, r):
            stages = {a.peer_id: 0, b.peer_id: 0, d.peer_id: 0, r.peer_id: 1}
            reports: list = []
            async with trio.open_nursery() as nursery:
                for host in (b, d):  # the replicas that recompute
                    _integrity(host, StageWorker(run, 0), corpus, stages, [], run).register(nursery)
                checker = _integrity(r, StageWorker(run, 1), corpus, stages, reports, run)
                checker.register(nursery)
                checker.monitor = None  # this test is about spot checks alone
                tokens = microbatch(run, corpus, 0, 1)[0]
                honest = StageWorker(run, 0).forward((0, 1), tokens)

                # An honest output passes: one recomputation agrees.
                frame, sig = _sent(a, honest, 0, 1, run, tokens)
                checker.observe(Received(a.peer_id, 0, "fwd", 0, 1, b"", frame, sig, honest))
                with trio.fail_after(20):
                    while checker.stats.checks_passed < 1:
                        await trio.sleep(0.05)
                assert not reports and checker.per_peer[a.peer_id] == [1, 0]

                # A flipped output: both recomputations disagree with it, so the evidence convicts A. (With the
                # subspace codec the part in span(U) is flipped: a tensor outside it could not be encoded at all.)
                fixed = 0.0 if run.subspace.rank is None else StageWorker(run, 0).module.subspace.fixed_embedding[tokens]
                lie = fixed - (honest - fixed)
                frame, sig = _sent(a, lie, 0, 1, run, tokens)
                checker.observe(Received(a.peer_id, 0, "fwd", 0, 1, b"", frame, sig, lie))
                with trio.fail_after(20):
                    while not reports:
                        await trio.sleep(0.05)
                accused, _, ev = reports[0]
                assert accused == a.peer_id and ev is not None and len(ev.outputs) == 3
                sub = StageWorker(run, 0).module.subspace if run.subspace.rank else None
                precisions = tuple(run.integrity.precisions)
                why = verify_evidence(ev, run_hash=run.run_hash(), codec=run.codec, check_tolerance=1e-3, shape=SHAPE,
                                      verify=verify_peer, limits=TensorLimits(max_elements=2048, max_bytes=65536), subspace=sub,
                                      precisions=precisions)
                assert "2 other replicas" in why and checker.per_peer[a.peer_id] == [1, 1]
                # In a run admitting bf16 each witness's bf16 recomputation came too, signed; the coordinator needs it.
                assert all(bool(o.low) == ("bf16" in precisions and o.signer != a.peer_id) for o in ev.outputs)
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=90)


def test_a_lying_first_witness_is_outvoted_and_reported_without_evidence(open_hosts, run_trio) -> None:
    """The first recomputation (by the checker's own pick) is flipped; the other drawn witness agrees with the
    checked output. The checked replica passes, and the liar is reported as a claim only: the draw was for
    the checked replica, so no evidence against the witness can convict it (coordinator/core/witnesses.py)."""
    corpus = load_corpus(RUN.data)

    async def main() -> None:
        async with open_hosts(4) as (a, b, d, r):
            stages = {a.peer_id: 0, b.peer_id: 0, d.peer_id: 0, r.peer_id: 1}
            liar, honest_witness = b, d
            reports: list = []
            async with trio.open_nursery() as nursery:
                _integrity(liar, StageWorker(RUN, 0), corpus, stages, [], outbound=_LyingChecks()).register(nursery)
                _integrity(honest_witness, StageWorker(RUN, 0), corpus, stages, []).register(nursery)
                # The checker's own first pick is the liar (its view held only it); the draw is both.
                checker = _integrity(r, StageWorker(RUN, 1), corpus, stages, reports, first_pick=[liar.peer_id])
                checker.register(nursery)
                checker.monitor = None
                tokens = microbatch(RUN, corpus, 0, 1)[0]
                honest = StageWorker(RUN, 0).forward((0, 1), tokens)
                frame, sig = _sent(a, honest, 0, 1, RUN, tokens)
                checker.observe(Received(a.peer_id, 0, "fwd", 0, 1, b"", frame, sig, honest))
                with trio.fail_after(20):
                    while not reports:
                        await trio.sleep(0.05)
                accused, reason, ev = reports[0]
                assert accused == liar.peer_id and ev is None and "disagreed with 1 drawn witness" in reason
                assert checker.per_peer[a.peer_id] == [1, 0] and checker.stats.checks_passed == 1
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)


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

