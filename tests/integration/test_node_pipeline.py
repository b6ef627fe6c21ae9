"""One pipeline hop over real libp2p hosts: the last stage's gradient is exactly the reference's, and
bad input (wrong shape, NaN, unknown microbatch, wrong route) is refused with a logged reason while
the node keeps working."""

from __future__ import annotations

import logging

import pytest
import torch
import trio
from protolearn.node.core.accounting import Accounting
from protolearn.node.core.routing import RouteCore
from protolearn.node.router import Router
from protolearn.node.worker import StageWorker
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import (
    ACTIVATION,
    GRADIENT,
    Ack,
    Activation,
    Gradient,
    Refuse,
)
from protolearn.protocol.statements import verify_ed25519
from protolearn.protocol.tensors import to_frame
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import load_corpus
from protolearn.stages.sampling import microbatch
from protolearn.stages.stage import build_stage

RUN = RunConfig.model_validate({
    "name": "hop", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16}, "data": {"max_bytes": 100_000},
})


async def send(host, peer: str, proto: str, msg, tensor: torch.Tensor):
    async with host.open_stream(peer, proto) as s:
        await s.send(msg)
        await s.send_tensor(to_frame(tensor))
        return await s.receive((Ack, Refuse))


def test_last_stage_hop_matches_the_reference_and_refuses_bad_input(open_hosts, run_trio, caplog: pytest.LogCaptureFixture) -> None:
    corpus = load_corpus(RUN.data)
    inputs, targets = microbatch(RUN, corpus, 0, 1)
    # The reference: stage 0 then stage 1 in this process.
    ref0, ref1 = build_stage(RUN, 0), build_stage(RUN, 1)
    hidden = ref0(("r", 1), inputs)  # (mb, T, D)
    ref1(("r", 1), hidden, targets)
    expected_grad = ref1.backward(("r", 1), None, loss_scale=1.0 / RUN.batch.microbatches_per_step)
    named = dict(ref1.named_parameters())
    expected_params = torch.cat([named[n].grad.reshape(-1).float() for n in ref1.param_names()])

    async def main() -> None:
        async with open_hosts(3) as (sender, receiver, first):
            worker = StageWorker(RUN, 1)
            acc = Accounting(RUN.batch.microbatches_per_step, max_in_flight=2, max_deferred=1)
            router = Router(receiver, RUN, worker, corpus, acc, trio.CapacityLimiter(1), routes=RouteCore(),
                            on_complete=None, send_timeout_s=5.0)  # type: ignore[arg-type]
            got: list[tuple[Gradient, torch.Tensor]] = []
            arrived = trio.Event()

            async def on_gradient(peer: str, s) -> None:
                msg = await s.receive(Gradient)
                frame = await s.receive_tensor()
                got.append((msg, torch.frombuffer(bytearray(frame.data), dtype=torch.float32).reshape(frame.shape)))
                await s.send(Ack())
                arrived.set()

            sender.serve_stream(GRADIENT, on_gradient)
            acc0 = Accounting(RUN.batch.microbatches_per_step, max_in_flight=2, max_deferred=1)
            router0 = Router(first, RUN, StageWorker(RUN, 0), corpus, acc0, trio.CapacityLimiter(1), routes=RouteCore(),
                             on_complete=None, send_timeout_s=5.0)  # type: ignore[arg-type]
            async with trio.open_nursery() as nursery:
                await nursery.start(router.serve)
                await nursery.start(router0.serve)
                me, there = sender.peer_id, receiver.peer_id
                good = hidden.detach()

                # Wrong shape: refused before compute; the stream is reset and the reason logged.
                with pytest.raises(ProtocolError):
                    await send(sender, there, ACTIVATION, Activation(step=0, ticket=1, route=[me]), good[:, :8])
                # NaN: refused with a reason (a signed one is evidence against its sender: node/integrity.py).
                bad = good.clone()
                bad[0, 0, 0] = float("nan")
                r = await send(sender, there, ACTIVATION, Activation(step=0, ticket=1, route=[me]), bad)
                assert isinstance(r, Refuse) and r.code == "invalid" and "NaN" in r.reason
                # A route that does not end at the sender.
                r = await send(sender, there, ACTIVATION, Activation(step=0, ticket=1, route=[there]), good)
                assert isinstance(r, Refuse) and r.code == "invalid"
                # A step the replica is not at.
                r = await send(sender, there, ACTIVATION, Activation(step=5, ticket=1, route=[me]), good)
                assert isinstance(r, Refuse) and "ahead" in r.reason
                # A gradient for a microbatch this (stage-0) replica never ran forward.
                r = await send(sender, first.peer_id, GRADIENT, Gradient(step=0, ticket=0, route=[first.peer_id, me], loss=1.0), good)
                assert isinstance(r, Refuse) and r.code == "unknown"
                # A gradient sent to the last stage, which never receives one.
                r = await send(sender, there, GRADIENT, Gradient(step=0, ticket=0, route=[there, me], loss=1.0), good)
                assert isinstance(r, Refuse) and r.code == "invalid"

                # The node still works: a good activation comes back as the exact reference gradient.
                r = await send(sender, there, ACTIVATION, Activation(step=0, ticket=1, route=[me]), good)
                assert isinstance(r, Ack)
                with trio.fail_after(20):
                    await arrived.wait()
                msg, grad = got[0]
                assert (msg.step, msg.ticket, msg.route) == (0, 1, [me, there])
                assert torch.equal(grad, expected_grad)
                # The last stage's ack rides back: its host key's signature of this ticket's route and loss,
                # which stage 0 hands the coordinator with the completion.
                statement = ack_statement(RUN.run_hash(), 0, 1, [me, there], msg.loss)
                assert msg.ack is not None and verify_ed25519(there, statement, msg.ack)
                assert not verify_ed25519(me, statement, msg.ack)
                assert acc.accumulated(0) == [1]

                # Stage 0 redoes the ticket (its route broke upstream): processed again, counted once.
                arrived = trio.Event()
                r = await send(sender, there, ACTIVATION, Activation(step=0, ticket=1, route=[me]), good)
                assert isinstance(r, Ack)
                with trio.fail_after(20):
                    await arrived.wait()
                assert torch.equal(got[1][1], expected_grad)
                flat = await trio.to_thread.run_sync(worker.flat_grads, 0, [1])
                assert torch.equal(flat, expected_params)  # one ticket's gradients, not two
                # A ticket whose completion the coordinator refused is never in the step's sum.
                assert torch.count_nonzero(await trio.to_thread.run_sync(worker.flat_grads, 0, [])) == 0
                nursery.cancel_scope.cancel()

    # Bad bytes are rejected (warning); a well-formed request the stage cannot take is refused (info):
    # both go through the host's per-peer digest, so a peer cannot flood the log with either.
    with caplog.at_level(logging.INFO, logger="protolearn"):
        run_trio(main, timeout=60)
    text = caplog.text
    assert "shape" in text and "NaN" in text and "unknown microbatch" in text
