"""State sync between real hosts: a joining replica downloads its stage from several replicas at once,
and installs it only if it is what the stage's majority reported (issue 12, attack 10)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
import trio

from protolearn.node.checkpoint import shared_leaves
from protolearn.node.config import NodeConfig
from protolearn.node.errors import SelfTestError, StateSyncError
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node import state_sync
from protolearn.node.state_sync import StateServer, fetch_state, fetch_state_split
from protolearn.node.syncing import StageSync
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import STATE, StateBundle, StateInfo, StateLeaf, StateRequest
from protolearn.protocol.tensors import to_frame
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


def _donor(applied: int, bump: float = 0.0, moments: float | None = None) -> tuple[StageWorker, list[int]]:
    """A stage-1 replica after ``applied`` steps, with AdamW state of moment ``moments`` when given; ``served``
    counts the snapshots it handed out."""
    w = StageWorker(RUN, 1)
    with torch.no_grad():
        for p in w.params:
            p.add_(0.01 * applied + bump)
            if moments is not None:
                w.optimizer.state[p] = {"step": torch.tensor(float(applied)), "exp_avg": torch.full_like(p, moments),
                                        "exp_avg_sq": torch.full_like(p, moments * moments)}
    w.applied = applied  # type: ignore[attr-defined]  # the test's own record: a node keeps it in its core
    return w, []


def test_a_joiner_takes_one_share_from_each_replica_and_gets_the_whole_state(open_hosts, run_trio) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            donors = [_donor(7), _donor(7)]
            for host, (w, served) in zip(hosts[:2], donors, strict=True):

                async def snap(w=w, served=served):
                    served.append(1)
                    return w.shared_snapshot(lambda: w.applied, True)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            joiner = StageWorker(RUN, 1)
            applied, claimed, entries, _ = await fetch_state_split(
                hosts[2], [h.peer_id for h in hosts[:2]], joiner, RUN.run_hash(), timeout_s=20.0
            )
            assert [len(s) for _, s in donors] == [1, 1]  # both replicas served a share
            assert applied == 7 and joiner.load(entries) == claimed == donors[0][0].state_hash()
            assert len(entries) == len(donors[0][0].snapshot())  # parameters and optimizer moments, all of them
            # A single donor still sends everything.
            _, alone, whole, _ = await fetch_state(hosts[2], hosts[0].peer_id, joiner, RUN.run_hash(), timeout_s=20.0)
            assert alone == claimed and whole.keys() == entries.keys()

    run_trio(main, timeout=60)


def test_replicas_that_hold_different_states_are_not_mixed(open_hosts, run_trio) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host, (w, _) in zip(hosts[:2], [_donor(7), _donor(7, bump=0.5)], strict=True):

                async def snap(w=w):
                    return w.shared_snapshot(lambda: w.applied, True)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            with pytest.raises(StateSyncError, match="different states"):
                await fetch_state_split(hosts[2], [h.peer_id for h in hosts[:2]], StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0)

    run_trio(main, timeout=60)


# -- issue 12, attack 10: a donor that lies about its state ---------------------------------------


class _Coordinator:
    """What StageSync asks the coordinator link: the frontier (``step``) and the stage's reported hashes."""

    def __init__(self, step: int, reported: list[tuple[str, int, str]] | None) -> None:
        self.step = step
        self.reported = reported  # None: the request fails

    async def stage_hashes(self, stage: int) -> list[cm.ParamHash]:
        if self.reported is None:
            raise ProtocolError("coordinator", "status unavailable")
        return [cm.ParamHash(peer_id=p, step=s, hash=h) for p, s, h in self.reported]


def _syncer(tmp_path: Path, host, link: _Coordinator, donors: list[str], waiting: list[str], timeout_s: float) -> tuple[StageSync, StageWorker, Progress]:
    config = NodeConfig(coordinator=f"/ip4/127.0.0.1/tcp/1/p2p/{host.peer_id}", data_dir=tmp_path, sync_timeout_s=timeout_s)
    progress = Progress(tmp_path / "node.jsonl", name="joiner", live=False, plain_every_s=3600.0)
    compute = trio.CapacityLimiter(1)
    worker = StageWorker(RUN, 1)
    sync = StageSync(
        config, host, link, worker, StagePersistence(config, RUN, progress, compute), compute, progress,  # type: ignore[arg-type]
        stage=1, run_hash=RUN.run_hash(), donors=lambda: donors, say_waiting=waiting.append,
    )
    return sync, worker, progress


def test_a_joiner_refuses_a_lying_donor_and_takes_the_majoritys_state(open_hosts, run_trio, tmp_path: Path) -> None:
    honest, liar = _donor(7), _donor(7, bump=0.5)
    good, bad = honest[0].state_hash(), liar[0].state_hash()

    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host, (w, _) in zip(hosts[:2], [liar, honest], strict=True):

                async def snap(w=w):
                    return w.shared_snapshot(lambda: w.applied, True)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            lying, true = hosts[0].peer_id, hosts[1].peer_id
            # The stage's replicas told the coordinator their hash after step 6: two honest ones and the liar.
            link = _Coordinator(7, [(true, 6, good), ("other", 6, good), (lying, 6, bad)])
            waiting: list[str] = []
            sync, worker, progress = _syncer(tmp_path, hosts[2], link, [lying, true], waiting, 30.0)
            with progress:
                assert await sync.sync(7) == 7
            assert worker.state_hash() == good
            synced = [e for e in map(json.loads, (tmp_path / "node.jsonl").read_text().splitlines()) if e.get("event") == "synced"]
            assert [e["donors"] for e in synced] == [[true]]  # the split download and the liar alone were refused

    run_trio(main, timeout=90)


@pytest.mark.parametrize("claims", ["its-own-hash", "the-stage-hash-and-digests"])
def test_a_donor_that_lies_about_the_optimizer_state_alone_is_refused_before_the_joiner_trains(
    open_hosts, run_trio, tmp_path: Path, caplog: pytest.LogCaptureFixture, claims: str,
) -> None:
    """The replicas' hash covers AdamW's moments, not only the parameters: a donor that sends the stage's
    parameters with other moments (which would make the joiner's next update differ from its stage's, and cost
    it a resync that nobody could pin on the donor) is refused, whichever hash it claims. Claiming its own, it is
    refused before it sends a tensor (the claim is judged first); claiming the stage's, with the stage's tensor
    digests, it is refused at its first lying tensor. Either way the joiner names it, takes its share of the split
    download from the honest replica, and trains on the stage's state."""
    honest, liar = _donor(7, moments=0.1), _donor(7, moments=0.1)
    with torch.no_grad():
        liar[0].optimizer.state[liar[0].params[0]]["exp_avg"].mul_(-50.0)
    good = honest[0].state_hash()
    assert liar[0].module.state_hash() == honest[0].module.state_hash() and liar[0].state_hash() != good

    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host, (w, _) in zip(hosts[:2], [liar, honest], strict=True):

                async def snap(w=w):
                    mine = w.shared_snapshot(lambda: w.applied, True)
                    if w is liar[0] and claims == "the-stage-hash-and-digests":
                        stage = honest[0].shared_snapshot(lambda: 7, False)
                        return mine._replace(state_hash=stage.state_hash, leaves=stage.leaves)
                    return mine

                StateServer(host, 1, RUN.run_hash(), snap).register()
            lying, true = hosts[0].peer_id, hosts[1].peer_id
            reported = [(true, 6, good), ("other", 6, good), (lying, 6, good if claims != "its-own-hash" else liar[0].state_hash())]
            sync, worker, progress = _syncer(tmp_path, hosts[2], _Coordinator(7, reported), [lying, true], [], 30.0)
            with progress, caplog.at_level(logging.INFO, logger="protolearn.node"):
                assert await sync.sync(7) == 7
            assert worker.state_hash() == good
            assert torch.equal(worker.optimizer.state[worker.params[0]]["exp_avg"], honest[0].optimizer.state[honest[0].params[0]]["exp_avg"])
            synced = [e for e in map(json.loads, (tmp_path / "node.jsonl").read_text().splitlines()) if e.get("event") == "synced"]
            assert [e["donors"] for e in synced] == [[true]]  # the liar's share came from the honest replica
            why = "refused before its download" if claims == "its-own-hash" else "does not match the digest it announced"
            failed = [r.getMessage() for r in caplog.records if "state share" in r.getMessage()]
            assert len(failed) == 1 and lying in failed[0] and why in failed[0], failed

    run_trio(main, timeout=90)


def test_an_export_takes_the_parameters_alone_still_checked_against_the_whole_states_hash(open_hosts, run_trio) -> None:
    """An export needs no optimizer state: it asks for the parameters alone (a third of the bytes), and each must
    match its digest among those of the whole state, whose root is the hash the stage's replicas report. A donor
    that sends other parameters under the stage's digests is refused at the first one, by name."""
    honest, liar = _donor(7, moments=0.1), _donor(7, moments=0.1)
    with torch.no_grad():
        liar[0].params[0].add_(1.0)
    stage = honest[0].shared_snapshot(lambda: 7, False)

    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host, (w, _) in zip(hosts[:2], [honest, liar], strict=True):

                async def snap(w=w):
                    return w.shared_snapshot(lambda: 7, False)._replace(state_hash=stage.state_hash, leaves=stage.leaves)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            claims: list[tuple[int, str]] = []

            async def check(donor: str, applied: int, claimed: str) -> None:
                claims.append((applied, claimed))

            got = await fetch_state(hosts[2], hosts[0].peer_id, StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0, check=check, params_only=True)
            assert claims == [(7, stage.state_hash)] and got.state_hash == stage.state_hash
            assert set(got.entries) == {f"param/{n}" for n in honest[0].names}  # no moments crossed
            assert all(torch.equal(got.entries[f"param/{n}"], p) for n, p in zip(honest[0].names, honest[0].params))
            with pytest.raises(ProtocolError, match="does not match the digest") as err:
                await fetch_state(hosts[2], hosts[1].peer_id, StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0, params_only=True)
            assert err.value.peer == hosts[1].peer_id

    run_trio(main, timeout=60)


@pytest.mark.parametrize("case", ["sound-device", "broken-device", "lying-donor"])
def test_a_joiner_passes_the_self_test_or_stops_with_one_line(open_hosts, run_trio, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Issue 11, probation: a joiner compares its output on the run's self-test input with its donor's,
    computed with the state it sent. A device that computes wrong (faked here by scaling the joiner's
    output: this machine has no broken GPU) stops before it trains, with one line saying what to do. A donor
    that sends a wrong result (its state is the stage's: the hash check passes) does not stop an honest joiner:
    where the donors disagree with the device, the joiner's CPU computes the reference with the installed state."""
    donor = _donor(7)
    good = donor[0].state_hash()

    async def main() -> None:
        async with open_hosts(2) as hosts:
            w = donor[0]

            async def snap():
                test = w.self_test() * (1.5 if case == "lying-donor" else 1.0)
                return w.shared_snapshot(lambda: w.applied, False)._replace(self_test=test.numpy().tobytes())

            StateServer(hosts[0], 1, RUN.run_hash(), snap).register()
            link = _Coordinator(7, [(hosts[0].peer_id, 6, good)])
            sync, worker, progress = _syncer(tmp_path, hosts[1], link, [hosts[0].peer_id], [], 30.0)
            if case == "broken-device":
                real = worker.self_test
                monkeypatch.setattr(worker, "self_test", lambda: real() * 1.5)
            with progress:
                if case == "broken-device":
                    with pytest.raises(SelfTestError, match="self-test failed: this device computes stage 1 .* faulty; fix it, or join with --device cpu"):
                        await sync.sync(7)
                else:
                    assert await sync.sync(7) == 7
            events = [e for e in map(json.loads, (tmp_path / "node.jsonl").read_text().splitlines()) if e.get("event") == "self_test"]
            assert [e["result"] for e in events] == (["failed"] if case == "broken-device" else ["passed"])
            if case == "lying-donor":
                assert events[0]["refereed"] and events[0]["far_donors"] == [hosts[0].peer_id]

    run_trio(main, timeout=90)


@pytest.mark.parametrize("reported", [None, []], ids=["hashes-request-fails", "nobody-reported"])
def test_with_no_hash_to_check_against_a_joiner_installs_nothing(open_hosts, run_trio, tmp_path: Path, reported) -> None:
    liar = _donor(7, bump=0.5)

    async def main() -> None:
        async with open_hosts(2) as hosts:
            served: list[int] = []

            async def snap():
                served.append(1)
                return liar[0].shared_snapshot(lambda: liar[0].applied, False)

            StateServer(hosts[0], 1, RUN.run_hash(), snap).register()
            waiting: list[str] = []
            sync, worker, progress = _syncer(tmp_path, hosts[1], _Coordinator(7, reported), [hosts[0].peer_id], waiting, 2.5)
            init = worker.state_hash()
            with progress, pytest.raises(StateSyncError, match="no replica reported one yet"):
                await sync.sync(7)
            assert worker.state_hash() == init and not served  # nothing downloaded, nothing installed
            assert any("waiting for its replicas' parameter hashes" in w for w in waiting)

    run_trio(main, timeout=60)


def test_a_claim_the_reports_could_not_tell_yet_is_judged_again_once_they_can(open_hosts, run_trio, tmp_path: Path) -> None:
    """The stage's reports of the donor's step arrive only after a first judgement of its claim gave up waiting
    for them: a later attempt of the same sync judges the same claim again and installs it, rather than refusing
    it for the rest of the sync (the stage may be idle, so no newer claim would come)."""
    donor = _donor(7)
    good = donor[0].state_hash()

    async def main() -> None:
        async with open_hosts(2) as hosts:
            StateServer(hosts[0], 1, RUN.run_hash(), lambda: _snap(donor[0])).register()
            # Only a report of an older step at first: a replica whose report of step 6 is a heartbeat late.
            link = _Coordinator(7, [(hosts[0].peer_id, 5, "older"), ("other", 5, "older")])
            sync, worker, progress = _syncer(tmp_path, hosts[1], link, [hosts[0].peer_id], [], 30.0)
            asked = trio.Event()
            judge = sync._judge_claim

            async def judged(*args) -> None:
                try:
                    await judge(*args)
                finally:
                    asked.set()

            sync._judge_claim = judged  # type: ignore[method-assign]

            async def reports_catch_up() -> None:
                await asked.wait()  # the first judgement ran out of polls
                link.reported = [(hosts[0].peer_id, 6, good), ("other", 6, good)]

            with progress:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reports_catch_up)
                    assert await sync.sync(7) == 7
            assert worker.state_hash() == good

    run_trio(main, timeout=60)


def test_a_share_whose_donor_fails_is_taken_from_another_and_the_others_are_kept(open_hosts, run_trio) -> None:
    """Three replicas split the state; one refuses partway (it left its stage). Its share comes from another
    replica, and the two shares already received are not downloaded again."""

    async def main() -> None:
        async with open_hosts(4) as hosts:
            donors = [_donor(7), _donor(7), _donor(7)]
            for k, (host, (w, served)) in enumerate(zip(hosts[:3], donors, strict=True)):

                async def snap(w=w, served=served, gone=(k == 1)):
                    served.append(1)
                    if gone:
                        return None  # the server refuses: this replica no longer serves the stage
                    return w.shared_snapshot(lambda: w.applied, False)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            joiner = StageWorker(RUN, 1)
            applied, claimed, entries, _ = await fetch_state_split(
                hosts[3], [h.peer_id for h in hosts[:3]], joiner, RUN.run_hash(), timeout_s=20.0
            )
            assert (applied, claimed) == (7, donors[0][0].state_hash())
            # Each sent its own share once; the lost share came from one of the two that finished theirs.
            assert sorted(len(s) for _, s in donors) == [1, 1, 2] and len(donors[1][1]) == 1
            assert {n for n, _ in donors[0][0].snapshot()} == set(entries)
            want = dict(donors[0][0].snapshot())
            assert all(torch.equal(entries[n], t) for n, t in want.items())

    run_trio(main, timeout=60)


def test_a_lost_share_from_a_replica_at_another_step_is_not_mixed_in(open_hosts, run_trio, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_sync, "MAX_STATE_PARTS", 2)  # two shares; the third replica is the spare

    async def main() -> None:
        async with open_hosts(4) as hosts:
            donors = [_donor(7), _donor(7), _donor(8)]  # the spare has applied one more step
            for k, (host, (w, served)) in enumerate(zip(hosts[:3], donors, strict=True)):

                async def snap(w=w, served=served, gone=(k == 1)):
                    served.append(1)
                    return None if gone else w.shared_snapshot(lambda: w.applied, False)

                StateServer(host, 1, RUN.run_hash(), snap).register()
            joiner = StageWorker(RUN, 1)
            with pytest.raises(StateSyncError, match="different states"):
                await fetch_state_split(hosts[3], [h.peer_id for h in hosts[:3]], joiner, RUN.run_hash(), timeout_s=20.0)
            assert [len(s) for _, s in donors] == [1, 1, 1]  # the spare was asked for the refused share

    run_trio(main, timeout=60)


def test_when_every_donor_fails_the_split_download_fails_at_once(open_hosts, run_trio) -> None:
    async def main() -> None:
        async with open_hosts(3) as hosts:
            for host in hosts[:2]:

                async def snap():
                    return None

                StateServer(host, 1, RUN.run_hash(), snap).register()
            with trio.fail_after(10):  # no share waits for a donor that can never come free
                with pytest.raises(StateSyncError, match="split download failed"):
                    await fetch_state_split(hosts[2], [h.peer_id for h in hosts[:2]], StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0)

    run_trio(main, timeout=60)


@pytest.mark.parametrize("lie", ["out_of_order", "foreign_name", "repeated_name", "wrong_size", "non_finite", "oversized", "claim_mismatch", "digest_mismatch"])
def test_a_donor_whose_bundles_break_the_layout_is_refused_by_name_before_its_bytes_are_kept(
    open_hosts, run_trio, monkeypatch: pytest.MonkeyPatch, lie: str,
) -> None:
    """A donor sends its state in bundles: one message naming a run of tensors, then their raw bytes as one frame.
    Every way a bundle can break the stage's layout is a typed error naming the donor, and the joiner then serves on."""
    donor, _ = _donor(7)
    entries = donor.snapshot()
    if lie == "oversized":
        monkeypatch.setattr(state_sync, "BUNDLE_BYTES", 64)  # the joiner's bound; the liar bundles everything anyway

    async def liar(peer: str, s) -> None:
        await s.receive(StateRequest)
        leaves = shared_leaves(entries, diloco=False)
        claim = donor.state_hash()
        if lie == "claim_mismatch":  # digests of other tensors than the state it claims
            leaves = [(n, d[::-1]) if i == 0 else (n, d) for i, (n, d) in enumerate(leaves)]
        await s.send(StateInfo(stage=1, applied=7, run_hash=RUN.run_hash(), param_hash=claim, num_tensors=len(entries),
                               leaves=[StateLeaf(name=n, digest=d) for n, d in leaves]))
        first = [entries[0], entries[1]]
        if lie == "digest_mismatch":  # in the layout, but not the bytes it announced
            first = [entries[0], (entries[1][0], entries[1][1] + 1.0)]
        if lie == "out_of_order":
            first = [entries[1]]
        elif lie == "foreign_name":
            first = [("param/not.a.weight", entries[0][1])]
        elif lie == "non_finite":
            bad = entries[1][1].clone()
            bad.view(-1)[0] = float("nan")
            first = [entries[0], (entries[1][0], bad)]
        elif lie == "oversized":
            first = entries
        elif lie == "repeated_name":  # a whole first bundle, then one that names its tensor again
            await s.send(StateBundle(indices=[0], names=[entries[0][0]]))
            await s.send_tensor(to_frame(state_sync.packed([entries[0][1]])))
            first = [(entries[0][0], entries[1][1])]
        indices = [1] if lie in ("out_of_order", "repeated_name") else list(range(len(first)))
        await s.send(StateBundle(indices=indices, names=[n for n, _ in first]))
        raw = state_sync.packed([t for _, t in first])
        if lie == "wrong_size":
            raw = torch.cat([raw, torch.zeros(4, dtype=torch.uint8)])
        await s.send_tensor(to_frame(raw))
        with contextlib.suppress(ProtocolError):
            await s.receive(StateRequest)  # until the joiner hangs up

    async def main() -> None:
        async with open_hosts(2) as (bad, joiner):
            bad.serve_stream(STATE, liar)
            with pytest.raises(ProtocolError) as err:
                await fetch_state(joiner, bad.peer_id, StageWorker(RUN, 1), RUN.run_hash(), timeout_s=20.0)
            assert err.value.peer == bad.peer_id
            print(f"{lie}: {err.value.reason}")
            expected = {"out_of_order": "expected the next of", "foreign_name": "unexpected state tensor", "repeated_name": "unexpected state tensor", "wrong_size": "exceeds the limit",
                        "non_finite": "non-finite", "oversized": "a donor bundles at most",
                        "claim_mismatch": "not to the state hash", "digest_mismatch": "does not match the digest it announced"}[lie]
            assert expected in err.value.reason
            # The joiner goes on: an honest donor's state arrives whole.
            honest = StageWorker(RUN, 1)
            StateServer(bad, 1, RUN.run_hash(), lambda: _snap(donor)).register()
            _, claimed, got, _ = await fetch_state(joiner, bad.peer_id, honest, RUN.run_hash(), timeout_s=20.0)
            assert honest.load(got) == claimed == donor.state_hash()

    run_trio(main, timeout=60)


async def _snap(w: StageWorker):
    return w.shared_snapshot(lambda: 7, False)


def test_a_stranger_holding_state_streams_open_does_not_keep_a_joiner_out(open_hosts, run_trio) -> None:
    """Anyone can open state streams to a replica and hold them (a download sent slowly, or a request never
    sent). Peers outside the replica's stage share two of its four streams, at most two each, so the stage's
    joiner still syncs. Before, one stranger's four open streams took every slot and the joiner was refused."""
    donor = _donor(7)

    async def main() -> None:
        async with open_hosts(4) as (server, joiner, stranger, other):
            w = donor[0]

            async def snap():
                return w.shared_snapshot(lambda: w.applied, False)

            StateServer(server, 1, RUN.run_hash(), snap, members=lambda: {joiner.peer_id}).register()
            async with contextlib.AsyncExitStack() as held:
                for peer in (stranger, stranger, stranger, other, other):
                    with contextlib.suppress(ProtocolError):
                        await held.enter_async_context(peer.open_stream(server.peer_id, STATE))
                with trio.fail_after(10):
                    while server.active_streams(STATE) < 2:
                        await trio.sleep(0.01)
                applied, claimed, entries, _ = await fetch_state(joiner, server.peer_id, StageWorker(RUN, 1), RUN.run_hash(), timeout_s=10.0)
                assert (applied, claimed) == (7, w.state_hash()) and server.active_streams(STATE) >= 2

    run_trio(main, timeout=60)
