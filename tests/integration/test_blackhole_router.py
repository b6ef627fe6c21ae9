"""Issue 11 over real libp2p hosts: a stage-1 blackhole Acks an activation and never sends the gradient
back; stage 0 gives up on it after the deadline, its balancer stops choosing that peer, and the ticket
redone on the honest replica completes."""

from __future__ import annotations

import trio
from protolearn.node.core.accounting import Accounting
from protolearn.node.core.routing import RouteCore
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.node.router import Router
from protolearn.node.worker import StageWorker
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.statements import verify_ed25519
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import load_corpus

RUN = RunConfig.model_validate({
    "name": "hole", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16}, "data": {"max_bytes": 100_000},
})


class Withhold(Outbound):
    """A blackhole's filter: it takes every activation and never answers."""

    def withholds(self, step: int) -> bool:
        return step >= 0


def test_a_stage1_blackhole_loses_the_microbatch_and_the_redo_completes_on_the_honest_replica(open_hosts, run_trio) -> None:
    corpus = load_corpus(RUN.data)

    async def main() -> None:
        async with open_hosts(3) as (first, hole, good):
            def router(host, stage: int, on_complete=None, outbound: Outbound = PASS_THROUGH) -> Router:
                acc = Accounting(RUN.batch.microbatches_per_step, max_in_flight=2, max_deferred=1)
                return Router(host, RUN, StageWorker(RUN, stage), corpus, acc, trio.CapacityLimiter(1), routes=RouteCore(),
                              on_complete=on_complete, outbound=outbound, send_timeout_s=5.0)  # type: ignore[arg-type]

            done: list[tuple[int, int, list[str]]] = []
            acks: list[tuple[float, bytes | None, bytes]] = []
            completed = trio.Event()

            async def on_complete(step: int, ticket: int, route: list[str], loss: float, ack: bytes | None, nonce: bytes) -> None:
                done.append((step, ticket, route))
                acks.append((loss, ack, nonce))
                completed.set()

            r0 = router(first, 0, on_complete)
            r_hole, r_good = router(hole, 1, outbound=Withhold()), router(good, 1)
            async with trio.open_nursery() as nursery:
                for r in (r0, r_hole, r_good):
                    await nursery.start(r.serve)
                # The blackhole takes the microbatch (Ack) and drops it: nothing comes back, nothing is held.
                r0.routes.next_peers = [hole.peer_id]
                assert await r0.start_ticket(0, 0)
                assert r0.routes.handed_to(0, hole.peer_id) == [0]
                await trio.sleep(1.0)
                assert not done and r_hole.accounting.num_in_flight == 0 and r_hole.stats.microbatches == 0
                # Past the deadline stage 0 gives the microbatch up and penalises the peer...
                assert r0.routes.overdue(trio.current_time(), cap_s=0.5) == [((0, 0), hole.peer_id)]
                assert r0.routes.lost(hole.peer_id) == 1
                # ...so the redo goes to the honest replica and completes.
                r0.routes.next_peers = [hole.peer_id, good.peer_id]
                nonce = bytes(range(16))  # the redo's lease nonce, as the coordinator gave it
                assert await r0.start_ticket(0, 0, nonce)
                assert r0.routes.handed_to(0, good.peer_id) == [0] and r0.routes.handed_to(0, hole.peer_id) == []
                with trio.fail_after(20):
                    await completed.wait()
                assert done == [(0, 0, [first.peer_id, good.peer_id])]
                # The nonce travelled to the last stage and back, signed into its ack.
                (loss, ack, back), = acks
                assert back == nonce and ack is not None
                assert verify_ed25519(good.peer_id, ack_statement(r0.run_hash, 0, 0, done[0][2], loss, nonce), ack)
                assert r0.routes.overdue(trio.current_time() + 1e3, cap_s=1e6) == []  # it came back: not awaited
                assert r0.routes.deadline_s(cap_s=60.0) >= r0.routes.balancer.min_deadline_s
                nursery.cancel_scope.cancel()

    run_trio(main, timeout=60)
