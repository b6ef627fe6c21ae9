"""Bench suite ``coordinator``: the coordinator core's request paths against the swarm's size.

``python scripts/bench.py coordinator --json [--sizes 100,1000,10000] [--stages 2] [--repeat 5]``

No network: each size builds a :class:`~protolearn.coordinator.core.dispatch.CoordinatorCore`, fills it with
that many live, training members through :meth:`CoordinatorCore.restore` (as after a restart), and
then calls :meth:`CoordinatorCore.handle` directly with pre-built messages, so what is timed is the
core's own work (decoding and encoding belong to the transport):

- ``heartbeat_ms``: a member's heartbeat in a steady swarm: each member flips between training and
  averaging every step, reports the step it applied, and sends the view version its last reply gave
  it (nobody joins or leaves meanwhile);
- ``join_ms``: a new member's join, reply (with its view) included;
- ``lease_ms``: a stage-0 member leasing a ticket (handed back, untimed, after each);
- ``status_ms``: ``swarm status`` (it lists every node, so it grows with the swarm by design).

Each is the fastest of ``--repeat`` batches' mean time per call (other work on a shared machine
only adds time), in milliseconds, keyed ``<name>_ms_<size>``; a heartbeat batch is 1,000 calls at
every size. ``heartbeat_growth`` is the largest size's heartbeat time over the smallest's
(goal <= 2, and a heartbeat at 10,000 members <= 0.3 ms). ``join_reply_bytes_<size>`` and
``view_reply_bytes_<size>`` are encoded sizes: a join reply, and a heartbeat reply to a node whose
stage lost a replica since its last beat (``view_delta_bytes_<size>``, when the core offers deltas,
is the same reply to a node that merges them).
"""

from __future__ import annotations

import argparse
import gc
import time
import zlib
from collections.abc import Callable
from typing import Any

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.run import RunInfo
from protolearn.protocol import coordination as cm
from protolearn.protocol.wire import encode

# Batches per measurement are this many calls (fewer for the slow status request).
HEARTBEATS_PER_BATCH = 1000
JOINS_PER_BATCH = 50
LEASES_PER_BATCH = 200
TICKETS = 64
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_id(i: int, salt: str = "") -> str:
    """A deterministic, realistic-length (52 character) libp2p peer ID."""
    h = zlib.crc32(f"{salt}{i}".encode())
    tail = "".join(_B58[(h >> (k % 28)) % 58 ^ (k % 2)] for k in range(36))
    return f"12D3KooW{i:08d}{tail}"


def make_core(num_members: int, num_stages: int) -> CoordinatorCore:
    settings = CoordinatorSettings(rate_per_s=1e9, rate_burst=1e9, max_members=10 * max(1, num_members) + 10_000)
    run = RunInfo(
        name="bench", run_hash="0" * 64, run_toml="[model]\n" + "# padding\n" * 200,
        layers=(4,) * num_stages, microbatches_per_step=TICKETS, tokens_per_step=TICKETS * 1024,
    )
    core = CoordinatorCore(run, settings, peer_id="coordinator", started_at=0.0)
    members = [
        Member(
            peer_id=peer_id(i), addrs=[f"/ip4/10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/tcp/4001"], device="cuda",
            memory_gb=24.0, throughput=1000.0 + i % 7, stage=i % num_stages, joined_at=0.0, last_seen=0.0,
            name=f"n{i}", state="training", step=9, param_hash="ab" * 32, serving=i % num_stages,
        )
        for i in range(num_members)
    ]
    core.restore(members=members, step=10, tickets=[], closed=[], history=[], bans=[], now=0.0, committed=9)
    return core


def _best_ms(batches: int, batch: Callable[[int], float]) -> float:
    """The fastest of ``batches`` batches' mean seconds per call, in ms: on a shared machine, other
    work only ever adds time."""
    gc.collect()
    return 1e3 * min(batch(b) for b in range(batches))


def measure(num_members: int, num_stages: int, repeat: int) -> dict[str, Any]:
    core = make_core(num_members, num_stages)
    now = 1.0
    ids = [peer_id(i) for i in range(num_members)]
    stage_of = {p: core.registry.members[p].stage for p in ids}
    sample = ids[: min(num_members, HEARTBEATS_PER_BATCH)]
    calls = [sample[k % len(sample)] for k in range(HEARTBEATS_PER_BATCH)]

    held = {}  # the view version each node holds, from its last reply (the first one: untimed)
    for p in sample:
        held[p] = core.handle(p, cm.Heartbeat(state="training", step=9, param_hash="ab" * 32, stage=stage_of[p]), now).view_version
    flips = dict.fromkeys(sample, 0)

    def heartbeats(b: int) -> float:
        # A steady swarm: each beat finds its node flipped between training and averaging (every step
        # does that), reporting the step it applied and the view version its last reply gave it.
        msgs = []
        for k, p in enumerate(calls):
            flips[p] += 1
            step = 9 + flips[p] // 2
            msgs.append(cm.Heartbeat(
                state="averaging" if flips[p] % 2 else "training", throughput=1000.0 + k % 5, queue_len=k % 3, step=step,
                param_hash=f"{step:064x}", loss=2.5, view_version=held[p], stage=stage_of[p],
            ))
        t0 = time.perf_counter()
        for p, msg in zip(calls, msgs, strict=True):
            reply = core.handle(p, msg, now)
            if reply.view_changed:
                held[p] = reply.view_version
        return (time.perf_counter() - t0) / len(calls)

    heartbeat_ms = _best_ms(repeat, heartbeats)

    stage0 = [p for p in ids if core.registry.members[p].stage == 0][:LEASES_PER_BATCH]

    def leases(b: int) -> float:
        msg = cm.Lease(max_tickets=1)
        spent = 0.0
        for p in stage0:
            t0 = time.perf_counter()
            reply = core.handle(p, msg, now)
            spent += time.perf_counter() - t0
            assert isinstance(reply, cm.LeaseReply) and reply.indices, reply.reason
            core.handle(p, cm.Release(step=reply.step, indices=reply.indices), now)
        return spent / len(stage0)

    lease_ms = _best_ms(repeat, leases)

    join_msg = cm.Join(addrs=["/ip4/192.168.1.7/tcp/4001"], device="cuda", memory_gb=24.0, throughput=1000.0, name="new")
    join_bytes = 0

    def joins(b: int) -> float:
        nonlocal join_bytes
        fresh = [peer_id(k, salt=f"join{b}") for k in range(JOINS_PER_BATCH)]
        t0 = time.perf_counter()
        for p in fresh:
            reply = core.handle(p, join_msg, now)
        dt = time.perf_counter() - t0
        join_bytes = len(encode(reply))
        for p in fresh:
            core.handle(p, cm.Leave(reason="bench"), now)
        return dt / len(fresh)

    join_ms = _best_ms(repeat, joins)

    # Two nodes of one stage, current (one takes snapshots, one deltas); then a replica of theirs leaves.
    snap, delta, gone = [p for p in ids if stage_of[p] == stage_of[ids[0]]][:3]
    hb = cm.Heartbeat(state="training", step=9, param_hash="ab" * 32, view_version=held.get(snap, -1), stage=stage_of[snap])
    hb = hb.model_copy(update={"view_version": core.handle(snap, hb, now).view_version})
    out: dict[str, Any] = {}
    has_delta = "view_delta" in cm.Heartbeat.model_fields
    if has_delta:
        dhb = hb.model_copy(update={"view_delta": True, "stage": stage_of[delta]})
        dhb = dhb.model_copy(update={"view_version": core.handle(delta, dhb, now).view_version})
    core.handle(gone, cm.Leave(reason="bench"), now)
    view_bytes = len(encode(core.handle(snap, hb, now)))
    if has_delta:
        out[f"view_delta_bytes_{num_members}"] = len(encode(core.handle(delta, dhb, now)))

    def statuses(b: int) -> float:
        t0 = time.perf_counter()
        core.handle("operator", cm.StatusRequest(loss_history=0), now)
        return time.perf_counter() - t0

    status_ms = _best_ms(max(1, min(repeat, 3)), statuses)
    return {
        f"heartbeat_ms_{num_members}": heartbeat_ms,
        f"join_ms_{num_members}": join_ms,
        f"lease_ms_{num_members}": lease_ms,
        f"status_ms_{num_members}": status_ms,
        f"join_reply_bytes_{num_members}": join_bytes,
        f"view_reply_bytes_{num_members}": view_bytes,
        **out,
    }


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py coordinator", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="member counts, comma-separated (default: %(default)s)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default: %(default)s, the demo run's)")
    parser.add_argument("--repeat", type=int, default=5, help="batches per measurement (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} must be comma-separated member counts, e.g. 100,1000,10000")
    if not sizes or args.stages < 1 or args.repeat < 1 or sizes[0] < 3 * args.stages:
        parser.error("--stages and --repeat must be positive, and every size at least 3 members per stage")
    result: dict[str, Any] = {"sizes": sizes, "stages": args.stages}
    for n in sizes:
        result.update(measure(n, args.stages, args.repeat))
    result["heartbeat_growth"] = result[f"heartbeat_ms_{sizes[-1]}"] / result[f"heartbeat_ms_{sizes[0]}"]
    return result
