"""The coordinator as a user runs it: `coordinator start` as a subprocess, real protocol clients,
kill -9 and restart from the data dir, `swarm status --json` validated against its schema."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import trio
from protolearn.coordinator.core.status import STATUS_JSON_SCHEMA
from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.identity import Identity
from protolearn.protocol.statements import fin_statement
from protolearn.protocol.transport import TransportConfig, open_host
from protolearn.stages.config import default_run

CLI = [sys.executable, "-m", "protolearn.cli.main"]
STARTUP_S = 90.0
CFG = TransportConfig(request_timeout_s=10.0, connect_timeout_s=10.0)


class Coordinator:
    """A `protolearn coordinator start` subprocess whose one stdout line is its address."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.out = data_dir.parent / f"{data_dir.name}.out"
        self.err = data_dir.parent / f"{data_dir.name}.err"
        with self.out.open("w") as out, self.err.open("a") as err:
            self.proc = subprocess.Popen(
                [*CLI, "coordinator", "start", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data_dir), *extra],
                stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    async def address(self) -> str:
        with trio.fail_after(STARTUP_S):
            while True:
                text = self.out.read_text()
                if text.endswith("\n"):
                    return text.splitlines()[0]
                assert self.proc.poll() is None, self.err.read_text()[-3000:]
                await trio.sleep(0.02)  # fine-grained: the restart test times reconnects from here


async def cli(*args: str) -> subprocess.CompletedProcess:
    with trio.fail_after(STARTUP_S):
        return await trio.run_process([*CLI, *args], capture_stdout=True, capture_stderr=True, check=False)


def test_coordinator_survives_kill_9_with_members_step_leases_and_bans(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    B = default_run().batch.microbatches_per_step

    procs: list[subprocess.Popen] = []

    async def main() -> None:
        first = Coordinator(data, "--ban-on-evidence")
        procs.append(first.proc)
        addr = await first.address()
        assert "/p2p/12D3KooW" in addr
        idents = [Identity.generate() for _ in range(4)]
        async with trio.open_nursery() as nursery:
            hosts = [await nursery.start(_host, ident) for ident in idents]
            retry = RetryPolicy(retry_for_s=STARTUP_S, request_timeout_s=10.0)
            links = [CoordinatorLink(h, addr, retry=retry) for h in hosts]
            replies = [await lk.join(cm.Join(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0)) for lk in links]
            assert [r.stage for r in replies] == [0, 1, 0, 1]
            a, b, c, d = links
            for lk in links[:3]:
                # Answered before any lease: the step's shares count a and c as training (the loop's first
                # beat may come after a's lease on a loaded machine, and a then got the whole step).
                await lk.heartbeat(cm.Heartbeat(state="training", throughput=100.0))
                await nursery.start(lk.heartbeat_loop, lambda: cm.Heartbeat(state="training", throughput=100.0))

            # one full step (stage-0 replicas a and c each lease their share), committed once both
            # stages averaged it and every live replica (a, b, c) holds the result; then two leased
            # tickets of step 1 held by a
            def ack(step: int, i: int, route: list[str], loss: float, nonce: bytes) -> bytes:
                """b's signed ack as the last stage, over the lease's nonce, as its router sends it back with the gradient."""
                return b.host.sign(ack_statement(replies[0].run_hash, step, i, route, loss, nonce))

            for lk in (a, c):
                lease = await lk.lease(B)
                assert lease.step == 0 and len(lease.indices) == B // 2
                for i, nonce in zip(lease.indices, lease.nonces, strict=True):
                    route = [lk.host.peer_id, b.host.peer_id]
                    await lk.complete(0, i, route, 3.0, ack(0, i, route, 3.0, nonce), nonce)
            assert not (await a.averaged(0, 1)).committed
            assert not (await b.averaged(0, 1)).committed
            assert (await c.averaged(0, 1)).committed
            held_lease = await a.lease(2)
            held, held_nonces = held_lease.indices, held_lease.nonces
            assert held == [0, 1]
            # reports without evidence never ban, however many
            for lk in (a, b, c):
                assert not (await lk.report(d.host.peer_id, "outlier activations")).banned
            # two results of one round that d signed are proof (this coordinator bans on evidence)
            round_dig = bytes(32)
            told = [fin_statement(round_dig, b"\x03", bytes([n]) * 32) for n in (1, 2)]
            proof = [cm.StatementEvidence(data=t, signature=d.host.sign(t)) for t in told]
            verdict = await a.report(d.host.peer_id, "equivocated in a round", proof[0], proof[1])
            assert verdict.banned

            before = json.loads((await cli("swarm", "status", "--coordinator", addr, "--json")).stdout)
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(timeout=30)

            second = Coordinator(data)
            procs.append(second.proc)
            assert await second.address() == addr  # same identity, same port
            # the leases survived, with their nonces (the restarted coordinator derives the same nonce key from
            # its identity): only a may complete them, and it can
            route = [a.host.peer_id, b.host.peer_id]
            await a.complete(1, held[0], route, 2.0, ack(1, held[0], route, 2.0, held_nonces[0]), held_nonces[0])
            try:
                route = [c.host.peer_id, b.host.peer_id]
                await c.complete(1, held[1], route, 2.0, ack(1, held[1], route, 2.0, held_nonces[1]), held_nonces[1])
            except Exception as err:  # noqa: BLE001 - checked below
                assert getattr(err, "code", None) == "not_leaseholder", err
            else:
                raise AssertionError("a lease survived the restart but another peer completed it")

            done = await cli("swarm", "status", "--coordinator", addr, "--json")
            assert done.returncode == 0, done.stderr.decode()[-2000:]
            after = json.loads(done.stdout)
            jsonschema.validate(after, STATUS_JSON_SCHEMA)
            assert after["coordinator"] == before["coordinator"]
            assert after["last_committed"] == 0  # the commit point survived the kill
            assert after["step"] == before["step"] == 1
            assert [p["step"] for p in after["loss_history"]] == [0]
            assert after["loss_history"][0]["loss"] == 3.0 and after["loss_history"][0]["tickets"] == B
            live = sorted(n["peer_id"] for n in after["nodes"])
            assert live == sorted(lk.host.peer_id for lk in (a, b, c))
            assert [s["replicas"] for s in after["stages"]] == [2, 1]
            assert [x["peer_id"] for x in after["bans"]] == [d.host.peer_id]
            assert {n["stage"] for n in after["nodes"] if n["peer_id"] == c.host.peer_id} == {0}

            # a banned peer is refused by the restarted coordinator's gate as well
            try:
                await CoordinatorLink(d.host, addr, retry=RetryPolicy(retry_for_s=0.0)).heartbeat(cm.Heartbeat(state="training"))
            except Exception as err:  # noqa: BLE001
                assert type(err).__name__ in ("PeerUnavailable", "CoordinatorRefused", "PeerTimeout"), err
            else:
                raise AssertionError("banned peer was answered after restart")

            # the human view renders the same state
            human = await cli("swarm", "status", "--coordinator", addr)
            text = human.stdout.decode()
            assert human.returncode == 0 and "run demo" in text and "banned" in text, text
            # (AT RISK: the verdict word for a training swarm with a stage of a single replica, since schema 4.)
            assert "HEALTHY" in text or "DEGRADED" in text or "AT RISK" in text, text

            second.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                while second.proc.poll() is None:
                    await trio.sleep(0.1)
            assert second.proc.returncode == 0, second.err.read_text()[-2000:]
            assert second.out.read_text().splitlines() == [addr]  # stdout is the one line to paste
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)

    # a different run in the same data dir is one clear line and exit 1
    other = tmp_path / "other.toml"
    other.write_text(default_run().replace(seed=7).to_toml())
    proc = subprocess.run(
        [*CLI, "coordinator", "start", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data), "--config", str(other)],
        capture_output=True, text=True, timeout=STARTUP_S, check=False,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "use another --data-dir" in last and "Traceback" not in proc.stderr


RESTARTS = 3
# After kill -9 and a restart on the same data dir, every live node's next request succeeds soon
# after the new coordinator listens. The goal is ~2 s (issue 6): `scripts/bench.py restart` measures
# it. This test bounds it where a loaded 2-core machine cannot reach, and far below the 60 s that
# py-libp2p's dial ban would cost (a node that keeps failing dials, the regression this catches).
RECONNECT_S = 10.0


# Third-party noise: py-libp2p 0.8.1 now and then leaves the TCP socket of a connection whose remote
# was killed to the garbage collector (which closes it) instead of closing it.
@pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")
def test_every_client_reconnects_soon_after_each_kill_9_restart(tmp_path: Path) -> None:
    data = tmp_path / "coord"
    procs: list[subprocess.Popen] = []
    ok_at: list[list[float]] = [[], [], []]  # per client: monotonic times of successful heartbeats

    async def client(i: int, host, addr: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        link = CoordinatorLink(host, addr)  # the default retry policy is what nodes use
        await link.join(cm.Join(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0))
        task_status.started()
        while True:
            await link.heartbeat(cm.Heartbeat(state="training", throughput=100.0))
            ok_at[i].append(time.monotonic())
            await trio.sleep(0.1)

    async def main() -> None:
        coord = Coordinator(data)
        procs.append(coord.proc)
        addr = await coord.address()
        async with trio.open_nursery() as nursery:
            for i in range(len(ok_at)):
                host = await nursery.start(_host, Identity.generate())
                await nursery.start(client, i, host, addr)
            took: list[list[float]] = []
            for _ in range(RESTARTS):
                # Steady state before the kill: every client heartbeats this coordinator a few times.
                mark = time.monotonic()
                with trio.fail_after(30):
                    while not all(sum(t > mark for t in ts) >= 3 for ts in ok_at):
                        await trio.sleep(0.01)
                coord.proc.send_signal(signal.SIGKILL)
                coord.proc.wait(timeout=30)
                coord = Coordinator(data)
                procs.append(coord.proc)
                assert await coord.address() == addr
                listening = time.monotonic()
                with trio.fail_after(30):
                    while not all(ts and ts[-1] > listening for ts in ok_at):
                        await trio.sleep(0.01)
                took.append([min(t for t in ts if t > listening) - listening for ts in ok_at])
            print(f"seconds from listening to each client's next success, per restart: {took}")
            assert max(max(r) for r in took) <= RECONNECT_S, f"seconds from listening to each client's next success, per restart: {took}"
            nursery.cancel_scope.cancel()

    # libp2p logs each failed stream open at ERROR with the connection as an argument; pytest keeps
    # those records past the test, and with them the connections' sockets.
    libp2p_log = logging.getLogger("libp2p")
    level = libp2p_log.level
    libp2p_log.setLevel(logging.CRITICAL)
    try:
        trio.run(main)
    finally:
        libp2p_log.setLevel(level)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        gc.collect()  # inside this test, so the ignore below covers it and nothing else


def test_swarm_status_of_an_unreachable_coordinator_is_one_line_and_exit_1() -> None:
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    proc = subprocess.run([*CLI, "swarm", "status", "--coordinator", dead, "--timeout", "3"], capture_output=True, text=True, timeout=STARTUP_S, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the coordinator" in lines[0], proc.stderr


async def _host(ident: Identity, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_host(ident, ["/ip4/127.0.0.1/tcp/0"], CFG) as host:
        task_status.started(host)
        await trio.sleep_forever()


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, deadline_s: float = STARTUP_S) -> list[str]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        lines = path.read_text().splitlines()
        if len(lines) >= n:
            return lines
        assert proc.poll() is None, f"exited {proc.returncode}: {lines[-5:]}"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} lines in {path} after {deadline_s} s")


def test_swarm_status_watch_streams_json_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path / "coord")
    procs = [coord.proc]
    try:
        addr = trio.run(coord.address)
        for mode in (["--json"], []):
            out, err = tmp_path / f"watch{len(mode)}.out", tmp_path / f"watch{len(mode)}.err"
            # FORCE_COLOR makes rich draw the live view into a file as it would on a terminal.
            with out.open("w") as o, err.open("w") as e:
                watch = subprocess.Popen(
                    [*CLI, "swarm", "status", "--coordinator", addr, "--watch", "--interval", "0.2", *mode],
                    stdout=o, stderr=e, env={**os.environ, "FORCE_COLOR": "1"},
                )
            procs.append(watch)
            if mode:  # one status object per line, each valid against the schema
                for line in _wait_for_lines(out, 3, watch)[:3]:
                    st = json.loads(line)
                    jsonschema.validate(st, STATUS_JSON_SCHEMA)
                    assert st["run"]["name"] == "demo"
            else:  # the live view is redrawn: the run's header shows up more than once
                end = time.monotonic() + STARTUP_S
                while out.read_text().count("run demo") < 2:
                    assert watch.poll() is None and time.monotonic() < end, err.read_text()[-2000:]
                    time.sleep(0.05)
            watch.send_signal(signal.SIGTERM)
            watch.wait(timeout=30)
            assert watch.returncode == 0, err.read_text()[-2000:]
            assert "Traceback" not in err.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
