"""Handing a stage's parameters and optimizer state to a replica that joins.

The donor side answers a :class:`StateRequest` with :class:`StateInfo` (applied steps, run hash,
parameter hash, tensor count) and then the tensors in bundles of up to BUNDLE_BYTES: a :class:`StateBundle`
naming them, then their raw bytes as one frame, which the bulk lane carries. One frame per tensor went in-stream
(under the lane's 1 MiB threshold) through Noise and yamux: about 1 s for the demo stage's 20 MB in a running
swarm on 2 cores. The snapshot is taken between optimizer steps (the node holds its step lock), so it is one
consistent state. A request may ask for one share of the tensors (index ≡ part mod parts): with
:func:`fetch_state_split` a joiner downloads from several replicas at once, each sending its share,
and takes the result only if every donor described the same state (applied steps and hash).

The joining side checks everything before installing it: the run hash, that every name is one of its
own parameters or their AdamW moments with the exact dtype and shape (the header is checked before the
payload is read), finiteness, and finally that the installed state (parameters and moments) hashes to what the donor
claimed and to what the stage's other replicas report to the coordinator, when they report that step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection

import torch
import trio

from protolearn.node.errors import StateSyncError
from protolearn.node.worker import StageWorker
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import MAX_BUNDLE_TENSORS, MAX_STATE_PARTS, STATE, Refuse, StateBundle, StateInfo, StateRequest
from protolearn.protocol.transport import FramedStream
from protolearn.protocol.tensors import TensorLimits, from_frame, to_frame
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")

# (applied, param hash, entries, the self-test output with this state as raw float32 bytes)
Snapshot = tuple[int, str, list[tuple[str, torch.Tensor]], bytes]

# A donor sends its tensors in runs of at most this many bytes (a larger tensor alone), each as one frame.
BUNDLE_BYTES = 8 * 1024 * 1024
# State streams a replica serves at once, and how many of them peers outside its stage (exporters, strangers) share.
MAX_STREAMS = 4
MAX_STRANGER_STREAMS = 2


def bundles(entries: list[tuple[int, str, torch.Tensor]]) -> list[list[tuple[int, str, torch.Tensor]]]:
    """``(index, name, tensor)`` entries in order, cut into runs of at most BUNDLE_BYTES and MAX_BUNDLE_TENSORS."""
    out: list[list[tuple[int, str, torch.Tensor]]] = []
    size = 0
    for e in entries:
        n = e[2].numel() * e[2].element_size()
        if not out or size + n > BUNDLE_BYTES or len(out[-1]) == MAX_BUNDLE_TENSORS:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``tensors``, one after the other, as one uint8 tensor."""
    return torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors])


class StateServer:
    """Serves this replica's state; ``take_snapshot`` returns it between steps (None while syncing)."""

    def __init__(
        self, host: Host, stage: int, run_hash: str, take_snapshot: Callable[[], Awaitable[Snapshot | None]],
        *, members: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``members``: the peers of this stage in the swarm (its joiners among them), which keep MAX_STREAMS -
        MAX_STRANGER_STREAMS streams to themselves; anyone else (an exporter, a stranger) shares the rest."""
        self.host = host
        self.stage = stage
        self.run_hash = run_hash
        self.take_snapshot = take_snapshot
        self.members = members

    def register(self) -> None:
        # A taker needs one stream at a time (a joiner takes one share from each donor, an exporter one stage
        # from each source), and may open the next while this side still closes the last: two per peer, so that
        # one peer cannot hold every stream.
        members = self.members
        known = None if members is None else (lambda peer: peer in members())
        self.host.serve_stream(STATE, self._handle, max_inbound=MAX_STREAMS, max_inbound_per_peer=2,
                               known=known, max_inbound_unknown=MAX_STRANGER_STREAMS if known else None)

    async def snapshot_of(self, stage: int) -> Snapshot | Refuse:
        """The state to serve for a request of ``stage``, or why not (a server of several stages overrides this)."""
        if stage != self.stage:
            return Refuse(code="stage", reason=f"this replica serves stage {self.stage}, not {stage}")
        snap = await self.take_snapshot()
        return Refuse(code="state", reason="this replica is still syncing its own state") if snap is None else snap

    async def _handle(self, peer: str, s: FramedStream) -> None:
        req = await s.receive(StateRequest)
        snap = await self.snapshot_of(req.stage)
        if isinstance(snap, Refuse):
            await s.send(snap)
            return
        if req.part >= req.parts:
            await s.send(Refuse(code="state", reason=f"part {req.part} of {req.parts} does not exist"))
            return
        applied, param_hash, entries, self_test = snap
        await s.send(StateInfo(
            stage=req.stage, applied=applied, run_hash=self.run_hash, param_hash=param_hash, num_tensors=len(entries), self_test=self_test,
        ))
        mine = [(i, name, t) for i, (name, t) in enumerate(entries) if i % req.parts == req.part]
        for run in bundles(mine):
            await s.send(StateBundle(indices=[i for i, _, _ in run], names=[name for _, name, _ in run]))
            await s.send_tensor(to_frame(await trio.to_thread.run_sync(packed, [t for _, _, t in run])))
        log.info("state served peer=%s stage=%d applied=%d part=%d/%d", peer, req.stage, applied, req.part, req.parts)


async def fetch_state(
    host: Host, donor: str, worker: StageWorker, run_hash: str, *, timeout_s: float, part: int = 0, parts: int = 1,
    self_tests: dict[str, bytes] | None = None,
) -> tuple[int, str, dict[str, torch.Tensor]]:
    """Download and validate ``donor``'s state (or its share ``part`` of ``parts``) for ``worker``'s stage;
    returns (applied, hash, entries), and puts the donor's self-test output in ``self_tests``.

    Nothing is installed here; the caller installs in its compute thread and compares hashes.
    """
    applied, param_hash, _total, entries = await _fetch(
        host, donor, worker, run_hash, timeout_s=timeout_s, part=part, parts=parts, self_tests=self_tests,
    )
    if parts == 1:
        _check_complete(donor, worker, entries)
    return applied, param_hash, entries


async def fetch_state_split(
    host: Host, donors: list[str], worker: StageWorker, run_hash: str, *, timeout_s: float, self_tests: dict[str, bytes] | None = None,
) -> tuple[int, str, dict[str, torch.Tensor]]:
    """Download the state from up to MAX_STATE_PARTS ``donors`` at once, each sending an equal share of the tensors.

    A share that fails (its donor left, refused or broke the stream) is asked of another donor, one that sent
    no share first, then one whose own share arrived, so the shares already received are kept when one donor
    leaves partway; a donor whose share failed is not asked again. Raises :class:`StateSyncError` when a share found no
    donor, or unless every share described the same state; the caller then falls back to one donor at a time.
    """
    parts = min(len(donors), MAX_STATE_PARTS)
    got: list[tuple[int, str, int, dict[str, torch.Tensor]] | None] = [None] * parts
    errors: list[str] = []
    unused = list(donors[parts:])  # those that sent no share, taken in order
    finished: list[str] = []  # those whose share arrived, free to send a lost one
    running = parts  # shares downloading now
    changed = trio.Event()  # set when a share arrives or fails: a donor may be free, or none may come

    def tell(delta: int) -> None:
        nonlocal running, changed
        running += delta
        changed.set()
        changed = trio.Event()

    async def next_donor() -> str | None:
        while True:
            if unused:
                return unused.pop(0)
            if finished:
                return finished.pop(0)
            if running == 0:
                return None
            await changed.wait()

    async def one(k: int) -> None:
        donor: str | None = donors[k]
        while donor is not None:
            try:
                got[k] = await _fetch(host, donor, worker, run_hash, timeout_s=timeout_s, part=k, parts=parts, self_tests=self_tests)
            except (ProtocolError, StateSyncError) as err:
                errors.append(f"{donor}: {err}")
                tell(-1)
                donor = await next_donor()
                if donor is not None:
                    tell(+1)
                    log.info("state share %d of %d failed (%s); asking %s for it", k, parts, errors[-1], donor)
            else:
                finished.append(donor)
                tell(-1)
                return

    async with trio.open_nursery() as nursery:
        for k in range(parts):
            nursery.start_soon(one, k)
    if any(r is None for r in got):
        raise StateSyncError(f"split download failed: {errors[0]}")
    described = {(r[0], r[1], r[2]) for r in got if r is not None}
    if len(described) != 1:
        raise StateSyncError(f"the {parts} donors hold different states {sorted((a, h[:12]) for a, h, _ in described)}")
    entries: dict[str, torch.Tensor] = {}
    for r in got:
        assert r is not None  # every share arrived, or this raised above
        entries.update(r[3])
    (applied, param_hash, _total), = described
    _check_complete(",".join(donors[:parts]), worker, entries)
    return applied, param_hash, entries


async def _receive_bundle(
    s: FramedStream, donor: str, worker: StageWorker, bundle: StateBundle, due: list[int], have: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The tensors ``bundle`` names, read from the frame that follows it. They must be the next of ``due`` in order,
    each one of the stage's own with its dtype and shape and none of those in ``have`` already, and all together no more than a donor bundles (BUNDLE_BYTES,
    or one tensor alone): every check is made before a payload byte is read."""
    if len(bundle.names) != len(bundle.indices) or bundle.indices != due[: len(bundle.indices)]:
        raise ProtocolError(donor, f"state bundle of tensors {bundle.indices[:4]}..., expected the next of {due[:4]}...")
    layout: list[tuple[str, torch.dtype, list[int], int]] = []
    named: set[str] = set()
    for name in bundle.names:
        expected = worker.expected(name)
        if expected is None or name in named or name in have:
            raise ProtocolError(donor, f"unexpected state tensor {name[:80]!r}")
        named.add(name)
        dtype, shape = expected
        layout.append((name, dtype, list(shape), math.prod(shape) * dtype.itemsize))
    total = sum(n for _, _, _, n in layout)
    if len(layout) > 1 and total > BUNDLE_BYTES:
        raise ProtocolError(donor, f"state bundle of {total} bytes in {len(layout)} tensors; a donor bundles at most {BUNDLE_BYTES}")
    limits = TensorLimits(max_elements=max(total, 1), max_bytes=total + 64)
    frame = await s.receive_tensor(codec="none", dtype=torch.uint8, shape=[total], limits=limits)
    raw = from_frame(frame, peer=donor, dtype=torch.uint8, shape=[total], limits=limits)
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, dtype, shape, n in layout:
        # A copy of its own bytes: the view needs its dtype's alignment, which an offset into the bundle may lack.
        t = raw[at : at + n].clone().view(dtype).reshape(shape)
        at += n
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(donor, f"state tensor {name[:80]!r} holds non-finite values")
        out[name] = t
    return out


def _check_complete(donor: str, worker: StageWorker, entries: dict[str, torch.Tensor]) -> None:
    missing = [n for n in worker.names if f"param/{n}" not in entries]
    if missing:
        raise ProtocolError(donor, f"state lacks {len(missing)} parameters, e.g. {missing[0]}")


async def _fetch(
    host: Host, donor: str, worker: StageWorker, run_hash: str, *, timeout_s: float, part: int, parts: int,
    self_tests: dict[str, bytes] | None = None,
) -> tuple[int, str, int, dict[str, torch.Tensor]]:
    entries: dict[str, torch.Tensor] = {}
    try:
        with trio.fail_after(timeout_s):
            async with host.open_stream(donor, STATE) as s:
                await s.send(StateRequest(stage=worker.stage, part=part, parts=parts))
                info = await s.receive((StateInfo, Refuse))
                if isinstance(info, Refuse):
                    raise StateSyncError(f"replica {donor} refused to share its state: {info.reason}")
                if info.stage != worker.stage or info.run_hash != run_hash:
                    raise StateSyncError(f"replica {donor} offered stage {info.stage} of run {info.run_hash[:12]}, not stage {worker.stage} of {run_hash[:12]}")
                if self_tests is not None and info.self_test:
                    self_tests[donor] = info.self_test
                most = (5 if worker.outer is not None else 4) * len(worker.names)  # parameters, AdamW's 3, DiLoCo's momentum
                if info.num_tensors > most:
                    raise ProtocolError(donor, f"state of {info.num_tensors} tensors; stage {worker.stage} has at most {most}")
                want = list(range(part, info.num_tensors, parts))
                while len(entries) < len(want):
                    bundle = await s.receive(StateBundle)
                    entries.update(await _receive_bundle(s, donor, worker, bundle, want[len(entries):], entries))
    except trio.TooSlowError:
        raise StateSyncError(f"state sync from replica {donor} did not finish within {timeout_s:g} s") from None
    return info.applied, info.param_hash, info.num_tensors, entries
