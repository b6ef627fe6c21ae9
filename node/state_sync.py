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
payload is read), finiteness, and the hash. :class:`StateInfo` announces the digest of every tensor the state's
hash covers (:func:`~protolearn.node.checkpoint.shared_leaves`); they must add up to the claimed hash
(:func:`~protolearn.stages.stage.state_root`), the claim is judged against what the stage's other replicas
report to the coordinator before a tensor is taken (``check``), and each tensor must match its digest as it
arrives. A lying donor therefore costs a joiner one message or one tensor, never a whole download, and the
error names it. Last, the installed state must hash to the claim (nothing outside it came along).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import NamedTuple

import torch
import trio

from protolearn.node.checkpoint import Snapshot
from protolearn.node.errors import StateSyncError
from protolearn.node.worker import StageWorker
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import MAX_BUNDLE_TENSORS, MAX_STATE_PARTS, STATE, Refuse, StateBundle, StateInfo, StateLeaf, StateRequest
from protolearn.protocol.transport import FramedStream
from protolearn.protocol.tensors import TensorLimits, from_frame, to_frame
from protolearn.protocol.transport import Host
from protolearn.stages.stage import PARAM_PREFIX, state_root, tensor_digest

log = logging.getLogger("protolearn.node")

# Asked of a donor's claim (donor, applied steps, state hash) once its tensors' digests add up to that hash and
# before any tensor is taken: raises StateSyncError to refuse the state (node/syncing.py judges it).
Check = Callable[[str, int, str], Awaitable[None]]

# A donor sends its tensors in runs of at most this many bytes (a larger tensor alone), each as one frame.
BUNDLE_BYTES = 8 * 1024 * 1024
# State streams a replica serves at once, and how many of them peers outside its stage (exporters, strangers) share.
MAX_STREAMS = 4
MAX_STRANGER_STREAMS = 2


class Fetched(NamedTuple):
    """A downloaded state: after ``applied`` steps, claimed to hash to ``state_hash``, sent by ``donors``."""

    applied: int
    state_hash: str
    entries: dict[str, torch.Tensor]
    donors: list[str]  # those whose share arrived and was kept, each once


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
        applied, param_hash, entries, self_test, leaves = snap
        if req.params_only:
            entries = [(name, t) for name, t in entries if name.startswith(PARAM_PREFIX)]
        await s.send(StateInfo(
            stage=req.stage, applied=applied, run_hash=self.run_hash, param_hash=param_hash, num_tensors=len(entries), self_test=self_test,
            leaves=[StateLeaf(name=n, digest=d) for n, d in leaves],
        ))
        mine = [(i, name, t) for i, (name, t) in enumerate(entries) if i % req.parts == req.part]
        for run in bundles(mine):
            await s.send(StateBundle(indices=[i for i, _, _ in run], names=[name for _, name, _ in run]))
            await s.send_tensor(to_frame(await trio.to_thread.run_sync(packed, [t for _, _, t in run])))
        log.info("state served peer=%s stage=%d applied=%d part=%d/%d", peer, req.stage, applied, req.part, req.parts)


async def fetch_state(
    host: Host, donor: str, worker: StageWorker, run_hash: str, *, timeout_s: float, part: int = 0, parts: int = 1,
    self_tests: dict[str, bytes] | None = None, check: Check | None = None, params_only: bool = False,
) -> Fetched:
    """Download and validate ``donor``'s state (or its share ``part`` of ``parts``) for ``worker``'s stage;
    puts the donor's self-test output in ``self_tests`` once its state arrived. ``check`` judges
    the donor's claim before a tensor is taken (see :data:`Check`); every tensor the hash covers must match
    the digest the donor announced for it. ``params_only``: the parameters alone (an export needs no optimizer
    state), still checked through the digests of the whole state, which add up to the hash its replicas report.

    Nothing is installed here; the caller installs in its compute thread and compares hashes.
    """
    applied, param_hash, _total, entries, leaves = await _fetch(
        host, donor, worker, run_hash, timeout_s=timeout_s, part=part, parts=parts, self_tests=self_tests, check=check,
        params_only=params_only,
    )
    if parts == 1:
        _check_complete(donor, worker, entries, {n: d for n, d in leaves.items() if n.startswith(PARAM_PREFIX)} if params_only else leaves)
    return Fetched(applied, param_hash, entries, [donor])


async def fetch_state_split(
    host: Host, donors: list[str], worker: StageWorker, run_hash: str, *, timeout_s: float, self_tests: dict[str, bytes] | None = None,
    check: Check | None = None,
) -> Fetched:
    """Download the state from up to MAX_STATE_PARTS ``donors`` at once, each sending an equal share of the tensors.

    A share that fails (its donor left, refused or broke the stream) is asked of another donor, one that sent
    no share first, then one whose own share arrived, so the shares already received are kept when one donor
    leaves partway; a donor whose share failed is not asked again (one whose claim ``check`` refused, or whose
    tensor did not match its digest, among them). Raises :class:`StateSyncError` when a share found no
    donor, or unless every share described the same state; the caller then falls back to one donor at a time.
    """
    parts = min(len(donors), MAX_STATE_PARTS)
    got: list[tuple[int, str, int, dict[str, torch.Tensor], dict[str, str]] | None] = [None] * parts
    errors: list[str] = []
    unused = list(donors[parts:])  # those that sent no share, taken in order
    finished: list[str] = []  # those whose share arrived, free to send a lost one
    senders: list[str] = [""] * parts  # who sent each share that arrived
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
                got[k] = await _fetch(host, donor, worker, run_hash, timeout_s=timeout_s, part=k, parts=parts, self_tests=self_tests, check=check)
            except (ProtocolError, StateSyncError) as err:
                errors.append(f"{donor}: {err}")
                tell(-1)
                donor = await next_donor()
                if donor is not None:
                    tell(+1)
                    log.info("state share %d of %d failed (%s); asking %s for it", k, parts, errors[-1], donor)
            else:
                finished.append(donor)
                senders[k] = donor
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
    leaves: dict[str, str] = {}
    for r in got:
        assert r is not None  # every share arrived, or this raised above
        entries.update(r[3])
        leaves = r[4]  # the same in every share: they hash to the same state
    (applied, param_hash, _total), = described
    _check_complete(",".join(donors[:parts]), worker, entries, leaves)
    return Fetched(applied, param_hash, entries, list(dict.fromkeys(senders)))


async def _receive_bundle(
    s: FramedStream, donor: str, worker: StageWorker, bundle: StateBundle, due: list[int], have: dict[str, torch.Tensor],
    only: str = "",
) -> dict[str, torch.Tensor]:
    """The tensors ``bundle`` names, read from the frame that follows it. They must be the next of ``due`` in order,
    each one of the stage's own with its dtype and shape and none of those in ``have`` already, and all together no more than a donor bundles (BUNDLE_BYTES,
    or one tensor alone), each named with the prefix ``only`` if given: every check is made before a payload byte is read."""
    if len(bundle.names) != len(bundle.indices) or bundle.indices != due[: len(bundle.indices)]:
        raise ProtocolError(donor, f"state bundle of tensors {bundle.indices[:4]}..., expected the next of {due[:4]}...")
    layout: list[tuple[str, torch.dtype, list[int], int]] = []
    named: set[str] = set()
    for name in bundle.names:
        expected = worker.expected(name)
        if expected is None or name in named or name in have or not name.startswith(only):
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


def _check_complete(donor: str, worker: StageWorker, entries: dict[str, torch.Tensor], leaves: dict[str, str]) -> None:
    missing = [n for n in worker.names if f"param/{n}" not in entries]
    if missing:
        raise ProtocolError(donor, f"state lacks {len(missing)} parameters, e.g. {missing[0]}")
    unsent = [n for n in leaves if n not in entries]
    if unsent:
        raise ProtocolError(donor, f"state lacks {len(unsent)} of the tensors its hash covers, e.g. {unsent[0][:80]!r}")


def _claimed_leaves(donor: str, worker: StageWorker, info: StateInfo, most: int) -> dict[str, str]:
    """The donor's (name, digest) leaves, each a tensor of this stage named once, every parameter among them,
    and adding up to the hash it claims (:func:`~protolearn.stages.stage.state_root`)."""
    pairs = [(leaf.name, leaf.digest) for leaf in info.leaves]
    leaves = dict(pairs)
    if len(leaves) != len(pairs) or len(leaves) > most:
        raise ProtocolError(donor, f"state of {info.num_tensors} tensors announced {len(info.leaves)} digests, some twice or too many")
    unknown = next((n for n in leaves if worker.expected(n) is None), None)
    if unknown is not None:
        raise ProtocolError(donor, f"announced a digest of {unknown[:80]!r}, which is not part of this stage's state")
    missing = [n for n in worker.names if f"param/{n}" not in leaves]
    if missing:
        raise ProtocolError(donor, f"announced no digest of {len(missing)} parameters, e.g. {missing[0]}")
    root = state_root(pairs)
    if root != info.param_hash:
        raise ProtocolError(donor, f"its tensors' digests hash to {root[:12]}, not to the state hash {info.param_hash[:12]} it claims")
    return leaves


def _mismatched(tensors: dict[str, torch.Tensor], leaves: dict[str, str]) -> str | None:
    """The first of ``tensors`` that the hash covers whose digest is not the announced one (None: all match)."""
    return next((n for n, t in tensors.items() if n in leaves and tensor_digest(n, t) != leaves[n]), None)


async def _fetch(
    host: Host, donor: str, worker: StageWorker, run_hash: str, *, timeout_s: float, part: int, parts: int,
    self_tests: dict[str, bytes] | None = None, check: Check | None = None, params_only: bool = False,
) -> tuple[int, str, int, dict[str, torch.Tensor], dict[str, str]]:
    entries: dict[str, torch.Tensor] = {}
    try:
        with trio.fail_after(timeout_s):
            async with host.open_stream(donor, STATE) as s:
                await s.send(StateRequest(stage=worker.stage, part=part, parts=parts, params_only=params_only))
                info = await s.receive((StateInfo, Refuse))
                if isinstance(info, Refuse):
                    raise StateSyncError(f"replica {donor} refused to share its state: {info.reason}")
                if info.stage != worker.stage or info.run_hash != run_hash:
                    raise StateSyncError(f"replica {donor} offered stage {info.stage} of run {info.run_hash[:12]}, not stage {worker.stage} of {run_hash[:12]}")
                most = (5 if worker.outer is not None else 4) * len(worker.names)  # parameters, AdamW's 3, DiLoCo's momentum
                if info.num_tensors > most:
                    raise ProtocolError(donor, f"state of {info.num_tensors} tensors; stage {worker.stage} has at most {most}")
                leaves = _claimed_leaves(donor, worker, info, most)
                if check is not None:
                    await check(donor, info.applied, info.param_hash)
                want = list(range(part, info.num_tensors, parts))
                while len(entries) < len(want):
                    bundle = await s.receive(StateBundle)
                    got = await _receive_bundle(s, donor, worker, bundle, want[len(entries):], entries, PARAM_PREFIX if params_only else "")
                    bad = await trio.to_thread.run_sync(_mismatched, got, leaves)
                    if bad is not None:
                        raise ProtocolError(donor, f"state tensor {bad[:80]!r} does not match the digest it announced for it")
                    entries.update(got)
                if self_tests is not None and info.self_test:  # a state refused or broken off leaves no result behind
                    self_tests[donor] = info.self_test
    except trio.TooSlowError:
        raise StateSyncError(f"state sync from replica {donor} did not finish within {timeout_s:g} s") from None
    return info.applied, info.param_hash, info.num_tensors, entries, leaves
