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
                statement = ack_statement(RUN.run_hash(), 0, 1, [me, there], msg.loss, b"")  # the activation had no nonce
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


RUN3 = RunConfig.model_validate({
    "name": "hops", "model": {"d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64, "max_seq_len": 32}, "stages": {"num_stages": 3},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16}, "data": {"max_bytes": 100_000},
})


def test_a_redo_through_another_upstream_replica_completes_and_applied_steps_leave_no_records(open_hosts, run_trio) -> None:
    """A middle stage gets ticket (0, 0) from one stage-0 replica, then its redo from another. The earlier
    attempt's gradient is refused for its route, and the held attempt's gradient is still taken (it used
    to be refused as "already being applied", and the ticket never completed). Once step 0 is applied,
    the first work of step 1 finds no record of step 0 left, though nothing was held for step 1."""
    hidden = torch.randn(RUN3.batch.microbatch_size, RUN3.batch.seq_len, RUN3.model.d_model, generator=torch.Generator().manual_seed(3))

    async def main() -> None:
        async with open_hosts(4) as (up1, up2, mid, down):
            acc = Accounting(RUN3.batch.microbatches_per_step, max_in_flight=4, max_deferred=2)
            routes = RouteCore()
            routes.next_peers = [down.peer_id]
            router = Router(mid, RUN3, StageWorker(RUN3, 1), None, acc, trio.CapacityLimiter(1), routes=routes,
                            on_complete=None, send_timeout_s=5.0)  # type: ignore[arg-type]
            forwarded: list[list[str]] = []
            came_back: dict[str, trio.Event] = {up1.peer_id: trio.Event(), up2.peer_id: trio.Event()}
            sent_on = trio.Event()

            async def on_activation(peer: str, s) -> None:  # the next stage takes every activation
                msg = await s.receive(Activation)
                await s.receive_tensor()
                forwarded.append(list(msg.route))
                await s.send(Ack())
                sent_on.set()

            def on_gradient_at(host):
                async def handler(peer: str, s) -> None:
                    await s.receive(Gradient)
                    await s.receive_tensor()
                    await s.send(Ack())
                    came_back[host.peer_id].set()
                return handler

            down.serve_stream(ACTIVATION, on_activation)
            up1.serve_stream(GRADIENT, on_gradient_at(up1))
            up2.serve_stream(GRADIENT, on_gradient_at(up2))
            async with trio.open_nursery() as nursery:
                await nursery.start(router.serve)
                m = mid.peer_id
                for up in (up1, up2):  # the first attempt, then the redo through the other stage-0 replica
                    sent_on = trio.Event()
                    r = await send(up, m, ACTIVATION, Activation(step=0, ticket=0, route=[up.peer_id]), hidden)
                    assert isinstance(r, Ack)
                    with trio.fail_after(20):
                        await sent_on.wait()
                assert forwarded == [[up1.peer_id, m], [up2.peer_id, m]]
                grad = torch.ones_like(hidden)
                r = await send(down, m, GRADIENT, Gradient(step=0, ticket=0, route=[up1.peer_id, m, down.peer_id], loss=1.0), grad)
                assert isinstance(r, Refuse) and r.code == "unknown" and "another route" in r.reason
                r = await send(down, m, GRADIENT, Gradient(step=0, ticket=0, route=[up2.peer_id, m, down.peer_id], loss=1.0), grad)
                assert isinstance(r, Ack), r
                with trio.fail_after(20):
                    await came_back[up2.peer_id].wait()
                assert not came_back[up1.peer_id].is_set()
                assert acc.accumulated(0) == [0]
                assert len(router.tickets) == 1

                acc.applied_step(0)  # no work was held for step 1
                sent_on = trio.Event()
                r = await send(up1, m, ACTIVATION, Activation(step=1, ticket=1, route=[up1.peer_id]), hidden)
                assert isinstance(r, Ack)
                with trio.fail_after(20):
                    await sent_on.wait()
                assert router.tickets.route((0, 0)) is None and router.tickets.frame((0, 0), "input") is None
                assert len(router.tickets) == 1  # step 1's ticket only
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)
