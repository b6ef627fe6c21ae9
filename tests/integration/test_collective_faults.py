"""The fault-tolerant collective over real libp2p hosts: one replica is killed at each phase.

Four replicas, each with its own host in its own cancel scope, run one round of the node's collective
(``Averager``, op ``sum``). The victim's scope is cancelled at a chosen point, which closes its host
and connections mid-whatever-it-was-doing. The survivors must end with bit-identical results, equal to
the sum of exactly the vectors :attr:`Averager.last_done` reports as in, and a survivor's own vector is
never left out.

Two more check what only real hosts show: a replica that signs a fin with a made-up result hash (with
its real key) makes the honest replicas fail, with its signed fin as evidence that checks out against its
peer ID; and a replica that finished a round answers a late probe of it with its signed fin (signed with
the host's key), or with ``left`` when the round failed there. With the reducer cross-check and a robust
rule, a replica that tampers with the parts it reduces makes every honest replica fail, and its checker
holds evidence that :func:`verify_reducer_fault` accepts from the peer IDs alone.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch
import trio
from protolearn.node.averaging import Averager, AveragingError
from protolearn.protocol.collective import Done, PartHeader, Send
from protolearn.protocol.identity import Identity
from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse
from protolearn.protocol.reducer_check import peer_id_public_key, verify_reducer_fault
from protolearn.protocol.collective.robust import Aggregation, robust_reduce
from protolearn.protocol.statements import fin_statement, members_mask, round_digest, verify_ed25519
from protolearn.protocol.transport import TransportConfig
from tests.support.hosts import open_member, open_mesh

# Killing a host while a survivor is dialling it can leave that survivor's half-made py-libp2p socket to
# the garbage collector. Collect after each test so it is reported here, and ignore only that warning.
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_sockets() -> Iterator[None]:
    yield
    gc.collect()


CONFIG = TransportConfig(request_timeout_s=5.0, chunk_timeout_s=5.0, connect_timeout_s=2.0)
STAGE = 2
ROUND = 11


class KillableAverager(Averager):
    """An Averager that cancels its own replica (``scope``) at ``kill_point``."""

    kill_point: str | None = None
    scope: trio.CancelScope | None = None

    def _kill(self) -> None:
        assert self.scope is not None
        self.scope.cancel()

    def _dispatch(self, actions: list) -> None:
        if self.scope is not None and self.scope.cancel_called:
            return
        if self.kill_point == "holding_parts" and any(isinstance(a, Send) and a.phase == "gather" for a in actions):
            self._kill()  # it holds every slice of its part and has reduced it; nothing of it leaves
            return
        super()._dispatch(actions)
        r = self._round
        if self.kill_point == "after_commit" and r is not None and r.committed is not None:
            self._kill()

    async def _send_part(self, a, round_id: int) -> None:
        await super()._send_part(a, round_id)
        if isinstance(a, Send) and (self.kill_point, a.phase) in (("mid_scatter", "scatter"), ("mid_gather", "gather")):
            self._kill()  # after its first part of that phase was acknowledged


async def run_case(
    numel: int, weights_by_rank: list[float], victim_rank: int | None, kill_point: str | None, *, floor_s: float = 3.0
) -> tuple[dict, dict]:
    """``floor_s``: the least a replica waits on a silent peer before suspecting it. Four hosts share one
    event loop here, and on two busy cores a live one can stay silent past a 1 s floor: then it is
    suspected, hears of it and fails its round, which this crash-fault test would count as a failure.
    A dead victim is found by its broken streams and refused probes, not by this wait."""
    ids = sorted((Identity.generate() for _ in weights_by_rank), key=lambda i: i.peer_id)
    weights = {ident.peer_id: w for ident, w in zip(ids, weights_by_rank)}
    gen = torch.Generator().manual_seed(numel)
    vectors = {ident.peer_id: torch.randn(numel, generator=gen) for ident in ids}
    addrs: dict[str, list[str]] = {}
    all_up = trio.Event()
    results: dict[str, Done] = {}
    survivors = {ident.peer_id for rank, ident in enumerate(ids) if rank != victim_rank}
    all_done = trio.Event()  # every survivor has its result

    async def replica(rank: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        me = ids[rank].peer_id
        with trio.CancelScope() as scope:
            async with open_member(ids[rank], CONFIG, addrs, all_up, task_status) as host:
                avg = KillableAverager(host, STAGE, numel, timeout_s=30.0, first_round=ROUND, floor_s=floor_s, sign=ids[rank].sign)
                avg.register()
                if rank == victim_rank:
                    avg.kill_point, avg.scope = kill_point, scope
                    if kill_point == "before_start":
                        return
                results[me] = await avg.run_round_detailed(ROUND, weights, vectors[me])
                if survivors <= set(results):
                    all_done.set()
                # Stay reachable (as a node would) until every survivor is done: a slower one may still
                # probe us or fetch from us. run_trio's deadline bounds the wait.
                await all_done.wait()

    async with trio.open_nursery() as nursery:
        for rank in range(len(ids)):
            await nursery.start(replica, rank)
        all_up.set()
    return weights, {"vectors": vectors, "results": results, "victim": None if victim_rank is None else ids[victim_rank].peer_id}


def check(weights: dict[str, float], out: dict) -> Done:
    vectors, results, victim = out["vectors"], out["results"], out["victim"]
    survivors = [p for p in weights if p != victim]
    assert set(survivors) <= set(results), f"survivors without a result: {set(survivors) - set(results)}"
    first = results[survivors[0]]
    for p in survivors:
        assert torch.equal(results[p].result, first.result), "survivors must hold bit-identical results"
        assert results[p].contributors == first.contributors
    assert {p for p in survivors if weights[p] > 0} <= set(first.contributors), "a survivor's vector was dropped"
    assert set(first.excluded) <= {victim}
    exact = sum((vectors[p].double() for p in first.contributors), torch.zeros(first.result.numel(), dtype=torch.float64))
    torch.testing.assert_close(first.result.double(), exact, rtol=1e-5, atol=1e-5)
    return first


@pytest.mark.parametrize(
    ("victim_rank", "kill_point"),
    [
        # A sender dies before sending anything, and after its first part went out.
        (1, "before_start"),
        (1, "mid_scatter"),
        # A reducer dies holding its slices (reduced, nothing sent), mid-gather, and after committing.
        (0, "holding_parts"),
        (3, "holding_parts"),
        (0, "mid_gather"),
        (2, "mid_gather"),
        (3, "after_commit"),
    ],
)
def test_survivors_agree_when_one_replica_dies(run_trio, victim_rank: int, kill_point: str) -> None:
    async def main() -> None:
        weights, out = await run_case(4099, [1.0, 2.0, 0.0, 3.0], victim_rank, kill_point)
        done = check(weights, out)
        if kill_point == "before_start":
            assert done.excluded == [out["victim"]]

    run_trio(main, timeout=40)


def test_no_fault_round_includes_everyone(run_trio) -> None:
    async def main() -> None:
        weights, out = await run_case(1001, [1.0, 1.0, 1.0, 1.0], None, None)
        done = check(weights, out)
        assert done.excluded == [] and done.contributors == sorted(weights)

    run_trio(main, timeout=30)


def test_a_large_vector_survives_a_sender_dying_mid_scatter(run_trio) -> None:
    async def main() -> None:
        weights, out = await run_case(2_000_003, [1.0, 1.0, 1.0, 1.0], 2, "mid_scatter")
        check(weights, out)

    run_trio(main, timeout=60)


class LyingAverager(Averager):
    """Runs the round honestly but signs and sends a fin with a made-up result hash to every other replica."""

    async def _send_part(self, a, round_id: int) -> None:
        if isinstance(a, Send) and a.phase == "fin":
            r = self._round
            assert r is not None
            digest = bytes(32)
            sig = self.sign(fin_statement(r._round_digest, members_mask(r.peers, a.contributors), digest))
            a = dataclasses.replace(a, digest=digest, signature=sig)
        await super()._send_part(a, round_id)


def test_a_lying_fin_fails_the_honest_replicas_round_with_evidence(run_trio) -> None:
    async def main() -> None:
        ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
        weights = {i.peer_id: 1.0 for i in ids}
        outcome: dict[str, object] = {}
        async with open_mesh(ids, CONFIG) as hosts:
            kinds = [Averager, LyingAverager, Averager]
            avgs = [kind(h, STAGE, 513, timeout_s=20.0, first_round=ROUND, sign=i.sign) for kind, h, i in zip(kinds, hosts, ids)]
            for a in avgs:
                a.register()

            async def one(k: int) -> None:
                try:
                    outcome[ids[k].peer_id] = await avgs[k].run_round(ROUND, weights, torch.full((513,), float(k)))
                except AveragingError as err:
                    outcome[ids[k].peer_id] = err

            async with trio.open_nursery() as n:
                for k in range(3):
                    n.start_soon(one, k)
            liar = ids[1].peer_id
            for k in (0, 2):
                assert isinstance(outcome[ids[k].peer_id], AveragingError), "an honest replica must fail, never apply"
                failed = avgs[k].last_failed
                assert failed is not None and liar in failed.missing and "different contributor set or result" in failed.reason
                # The liar's signed fin is in the evidence, and checks out for anyone holding its peer ID.
                assert any(e.peer == liar and verify_ed25519(e.peer, e.statement, e.signature) for e in failed.evidence)

    run_trio(main, timeout=40)


def test_a_late_probe_of_a_finished_round_gets_the_signed_fin_or_left(run_trio, open_hosts) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            a, b, prober = hosts
            avgs = [Averager(h, STAGE, 64, timeout_s=20.0, first_round=ROUND) for h in (a, b)]
            for x in avgs:
                x.register()
            weights = {a.peer_id: 1.0, b.peer_id: 1.0}
            async with trio.open_nursery() as n:
                for k, x in enumerate(avgs):
                    n.start_soon(x.run_round, ROUND, weights, torch.full((64,), float(k)))
            done = avgs[0].last_done
            assert done is not None

            async def probe(round_id: int):
                async with prober.open_stream(a.peer_id, COLLECTIVE) as s:
                    await s.send(PartHeader(round=round_id, stage=STAGE, phase="probe", part=0))
                    return await s.receive((Ack, Refuse, PartHeader))

            fin = await probe(ROUND)
            assert isinstance(fin, PartHeader) and fin.phase == "fin" and fin.signer == a.peer_id and fin.digest == done.digest
            statement = fin_statement(round_digest(ROUND, weights, 64, "sum"), members_mask(sorted(weights), fin.contributors), fin.digest)
            assert verify_ed25519(a.peer_id, statement, fin.signature), "the host's key signs: a peer checks it from the peer ID"
            # A round that failed here (b is gone: a times out alone) is answered with 'left'.
            avgs[0].timeout_s = 1.0
            with pytest.raises(AveragingError):
                await avgs[0].run_round(ROUND + 1, weights, torch.zeros(64))
            left = await probe(ROUND + 1)
            assert isinstance(left, Refuse) and left.code == "left"

    run_trio(main, timeout=40)


@pytest.mark.parametrize("tamperer", [None, 1])
def test_a_tampering_reducer_is_vetoed_with_evidence_over_real_hosts(run_trio, tamperer: int | None) -> None:
    agg = Aggregation("trimmed_mean", trim_fraction=0.25)
    numel = 3001

    async def main() -> None:
        ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
        weights = {i.peer_id: float(k + 1) for k, i in enumerate(ids)}
        gen = torch.Generator().manual_seed(5)
        vectors = [torch.randn(numel, generator=gen) * (k + 1) for k in range(3)]
        outcome: dict[int, object] = {}
        async with open_mesh(ids, CONFIG) as hosts:
            avgs = [Averager(h, STAGE, numel, timeout_s=20.0, first_round=ROUND, sign=i.sign, aggregation=agg, cross_check=True,
                             part_filter=(lambda j, part: part + 1.0) if k == tamperer else None)
                    for k, (h, i) in enumerate(zip(hosts, ids))]
            for a in avgs:
                a.register()

            async def one(k: int) -> None:
                try:
                    outcome[k] = await avgs[k].run_round(ROUND, weights, vectors[k])
                except AveragingError as err:
                    outcome[k] = err

            async with trio.open_nursery() as n:
                for k in range(3):
                    n.start_soon(one, k)
        honest = [k for k in range(3) if k != tamperer]
        if tamperer is None:
            bounds = [(0, 1001), (1001, 2001), (2001, 3001)]
            slices = {i.peer_id: v for i, v in zip(ids, vectors)}
            exact = torch.cat([robust_reduce({p: v[a:b] for p, v in slices.items()}, weights, weights, "sum", b - a, agg) for a, b in bounds])
            assert all(isinstance(outcome[k], torch.Tensor) and torch.equal(outcome[k], exact) for k in honest)
            return
        assert all(isinstance(outcome[k], AveragingError) for k in honest), "the wrong part is never applied"
        checker = avgs[(tamperer + 1) % 3].last_failed
        assert checker is not None and checker.missing == [ids[tamperer].peer_id] and checker.reducer_faults
        for fault in checker.reducer_faults:
            ok, why = verify_reducer_fault(fault, peer_id_public_key, aggregation_cfg=agg)
            assert ok and fault.reducer == ids[tamperer].peer_id, why

    run_trio(main, timeout=40)


class MuteAverager(Averager):
    """A member that never runs its round: it takes every part and answers every probe with an ack, so it
    looks alive for ever, and sends nothing of its own (no part, no fin, never "left")."""

    async def _handle(self, peer: str, s) -> None:
        msg = await s.receive((PartHeader,))
        if msg.phase not in ("probe", "fin"):
            await s.receive_tensor(codec="none", dtype=torch.float32, shape=None, limits=self._part_limits)
        await s.send(Ack())


def test_a_peer_the_coordinator_banned_is_out_of_the_round_at_once(run_trio) -> None:
    """Two honest replicas and a mute one. They go on without its vector once it is stuck, but a held-out
    peer that answers probes is never silent, so its fin is waited for until the round's timeout. The
    coordinator's ban (``Averager.peer_banned``, which the node calls for every ban it hears of) ends
    that wait at once: both finish with the same sum of their own two vectors."""
    numel = 257

    async def main() -> None:
        ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
        weights = {i.peer_id: 1.0 for i in ids}
        mute = 1
        honest = [0, 2]
        async with open_mesh(ids, CONFIG) as hosts:
            avgs = [(MuteAverager if k == mute else Averager)(h, STAGE, numel, timeout_s=120.0, first_round=ROUND, floor_s=3.0, sign=i.sign)
                    for k, (h, i) in enumerate(zip(hosts, ids))]
            for a in avgs:
                a.register()
            results: dict[int, Done] = {}

            async def one(k: int) -> None:
                results[k] = await avgs[k].run_round_detailed(ROUND, weights, torch.full((numel,), float(k + 1)))

            async with trio.open_nursery() as n:
                for k in honest:
                    n.start_soon(one, k)
                # Both commit without the mute replica, then wait for its fin.
                await wait_until(lambda: all(avgs[k]._round is not None and avgs[k]._round.committed is not None for k in honest), 60)
                assert not results, "a committed round waits for a live peer's fin"
                for k in honest:
                    avgs[k].peer_banned(ids[mute].peer_id, "liveness: test")
                with trio.fail_after(10):
                    while len(results) < len(honest):
                        await trio.sleep(0.05)
        first = results[honest[0]]
        assert torch.equal(results[honest[1]].result, first.result) and first.contributors == results[honest[1]].contributors
        assert first.excluded == [ids[mute].peer_id]
        assert torch.equal(first.result, torch.full((numel,), 1.0 + 3.0))

    run_trio(main, timeout=90)


async def wait_until(cond, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not cond():
            await trio.sleep(0.05)
