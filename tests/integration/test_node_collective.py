"""The collective adapter over real libp2p hosts: replicas end bit-identical with the exact sum."""

from __future__ import annotations

import torch
import trio

from protolearn.node.averaging import Averager
from protolearn.node.result_fetch import ask_order
from protolearn.protocol.collective.result_proof import vector_digest


def test_three_replicas_average_and_an_idle_one_fetches_the_result(open_hosts, run_trio) -> None:
    numel = 100_003  # not divisible by 3: uneven parts
    gen = torch.Generator().manual_seed(0)

    async def main() -> None:
        async with open_hosts(4) as hosts:
            avgs = [Averager(h, 1, numel, timeout_s=20.0, first_round=5) for h in hosts]
            for a in avgs:
                a.register()
            vectors = [torch.randn(numel, generator=gen) for _ in hosts]
            weights = {h.peer_id: float(k + 1) for k, h in enumerate(hosts[:3])}
            results: dict[int, torch.Tensor] = {}

            async def one(k: int) -> None:
                await trio.sleep(0.05 * k)  # staggered starts: early parts must be held, not lost
                if k < 3:
                    results[k] = await avgs[k].run_round(5, weights, vectors[k])
                else:
                    results[k] = await avgs[k].fetch_result(5, weights)

            async with trio.open_nursery() as n:
                for k in range(4):
                    n.start_soon(one, k)

            expected = vectors[0] + vectors[1] + vectors[2]
            for k in range(4):
                assert torch.equal(results[k], results[0]), f"replica {k} differs"
            torch.testing.assert_close(results[0], expected)
            # The idle replica's commit report names the same result hash as the participants' fins.
            digests = {avgs[k].last_done.digest for k in range(3)}
            assert len(digests) == 1 and vector_digest(results[3], len(weights)) in digests
            # The next round works too, with a different participant set.
            two = {hosts[0].peer_id: 1.0, hosts[3].peer_id: 2.0}
            async with trio.open_nursery() as n:
                out: dict[int, torch.Tensor] = {}

                async def second(k: int) -> None:
                    out[k] = await avgs[k].run_round(6, two, torch.full((numel,), float(k)))

                n.start_soon(second, 0)
                n.start_soon(second, 3)
            assert torch.equal(out[0], out[3]) and torch.equal(out[0], torch.full((numel,), 3.0))

    run_trio(main, timeout=60)


def test_a_left_out_replica_refuses_a_participants_made_up_result_and_takes_the_proven_one(open_hosts, run_trio) -> None:
    """Issue 27 (rule 1): a left-out replica used to take whatever the first participant it asked sent, and so
    voted for a liar's made-up result in the commit. Now a served result needs fins of a strict majority of the
    participants, which the liar cannot sign for."""
    numel = 1_001
    gen = torch.Generator().manual_seed(1)

    async def main() -> None:
        async with open_hosts(4) as hosts:
            participants, fetcher = hosts[:3], hosts[3]
            first = ask_order(fetcher.peer_id, 5, [h.peer_id for h in participants])[0]
            [liar] = [h for h in participants if h.peer_id == first]  # the first one the left-out replica asks
            avgs = {h.peer_id: Averager(h, 1, numel, timeout_s=20.0, first_round=5) for h in hosts}
            for a in avgs.values():
                a.register()
            weights = {h.peer_id: 1.0 for h in participants}
            results: dict[str, torch.Tensor] = {}

            async def average(h) -> None:
                results[h.peer_id] = await avgs[h.peer_id].run_round(5, weights, torch.randn(numel, generator=gen))

            async with trio.open_nursery() as n:
                for h in participants:
                    n.start_soon(average, h)
            # The liar now serves a made-up vector, with the honest fins it holds and a fin of its own for it.
            served, fins = avgs[liar.peer_id].finished._results[5]
            forged = served.clone()
            forged[0] += 1.0
            avgs[liar.peer_id].finished._results[5] = (forged, fins)
            with trio.fail_after(30):
                got = await avgs[fetcher.peer_id].fetch_result(5, weights)
            honest = next(h for h in participants if h is not liar)
            assert torch.equal(got, results[honest.peer_id]) and not torch.equal(got, forged)

    run_trio(main, timeout=60)
