"""Taking a finished round's result from its participants: the taker's side of :mod:`protolearn.node.finished_rounds`.

A replica that did not finish a round itself (the step's accounting left it out, or its own round failed
while the others finished) asks the round's other participants, one after another until the deadline, for
the round's full vector with :class:`ResultRequest`. Each taker asks them in an order of its own
(:func:`ask_order`), so the takers of a round spread over the participants' uplinks (in peer-id order, every
taker asked the same participant first, and its uplink carried every fetch of the step: the simulator check in
docs/BENCHMARKS.md). It accepts a vector only when the fins served with it prove it
(:func:`~protolearn.protocol.collective.result_proof.unproven`): a strict majority of the
participants signed a fin for the full contributor set and for this vector's result hash, against the round
digest the taker computes itself from the round's id, participants and weights, the vector's length, the
stage's aggregation rule, the cross-check and the round's slice compression. So every round of a compressed
sync is proven over exactly the vector it fetches: an ``int8`` / ``topk:F`` round's decoded float32 result, or
either of PowerSGD's factor rounds (their own lengths). An unproven vector is logged against its server and
never returned; a participant whose round failed there (``Refuse`` code ``left``) is not asked again, and one
that no longer keeps the round (``stale``) ends the fetch with :class:`ResultGone`: the caller resyncs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import torch
import trio
from protolearn.node.errors import AveragingError, ResultGone
from protolearn.protocol.collective.result_proof import HeldFin, unproven
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import COLLECTIVE, Refuse, ResultRequest, ResultServed
from protolearn.protocol.statements import Verify
from protolearn.protocol.tensors import TensorLimits, from_frame
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")

RETRY_S = 0.2  # pause between passes over the participants


def ask_order(me: str, round_id: int, participants: Iterable[str]) -> list[str]:
    """The participants other than ``me``, in the order ``me`` asks them for round ``round_id``'s result: by a hash
    of (taker, round, participant), so each taker has its own order and the first asks of a round's takers fall
    evenly on its participants. Whom a taker asks first earns nothing: a served vector counts only with its proof."""
    def rank(peer: str) -> bytes:
        return hashlib.blake2b(f"{me}\x00{round_id}\x00{peer}".encode(), digest_size=8).digest()

    return sorted((p for p in set(participants) if p != me), key=lambda p: (rank(p), p))


async def fetch_proven(
    host: Host, stage: int, round_id: int, weights: Mapping[str, float], *, numel: int, rule_tag: str, cross_check: bool,
    compression: str, verify: Verify, timeout_s: float, clock: Callable[[], float],
) -> torch.Tensor:
    """Round ``round_id``'s full vector (``numel`` float32 values) from one of its participants (``weights``:
    each one's weight) other than this host, proven as the module docstring says; ``rule_tag``, ``cross_check``
    and ``compression`` (the round's slice compression tag, "none" for raw rounds) are what its digest binds.
    Raises :class:`ResultGone` or :class:`AveragingError` (with the last reason) if no proven vector comes."""
    limits = TensorLimits(max_elements=max(1, numel), max_bytes=max(4, 4 * numel))
    deadline = clock() + 2 * timeout_s
    last = "no participant answered"
    participants = ask_order(host.peer_id, round_id, weights)
    left: set[str] = set()  # participants whose round failed there: they will never have a result
    while clock() < deadline:
        if participants and left >= set(participants):
            raise AveragingError(f"stage {stage}: the round of step {round_id} failed at every other participant: {last}")
        for peer in participants:
            if peer in left:
                continue
            try:
                with trio.fail_after(timeout_s + 5):
                    async with host.open_stream(peer, COLLECTIVE) as s:
                        await s.send(ResultRequest(round=round_id, stage=stage))
                        reply = await s.receive((ResultServed, Refuse), timeout=timeout_s + 5)
                        if isinstance(reply, Refuse):
                            if reply.code == "stale":  # it no longer keeps that round: the caller must resync
                                raise ResultGone(f"stage {stage}: {peer} no longer keeps step {round_id}: {reply.reason}")
                            if reply.code == "left":
                                left.add(peer)
                            last = f"{peer}: {reply.reason}"
                            continue
                        frame = await s.receive_tensor(codec="none", dtype=torch.float32, shape=[numel], limits=limits)
                result = from_frame(frame, peer=peer, dtype=torch.float32, shape=[numel], limits=limits, require_finite=True)
                fins = [HeldFin(f.signer, f.mask, f.digest, f.signature) for f in reply.fins]
                why = await trio.to_thread.run_sync(partial(
                    unproven, result, fins, round_id=round_id, weights=weights, op="sum", rule_tag=rule_tag,
                    cross_check=cross_check, compression=compression, verify=verify,
                ))
                if why:
                    last = f"{peer}: {why}"
                    host.log_refusal(peer, COLLECTIVE, "unproven", f"stage {stage} result of round {round_id}: {why}")
                    continue
                return result
            except ProtocolError as err:
                last = f"{peer}: {err.reason}"
            except trio.TooSlowError:
                last = f"{peer}: no answer within {timeout_s + 5:g} s"
            log.info("result fetch failed step=%d stage=%d peer=%s reason=%s", round_id, stage, peer, last)
        await trio.sleep(RETRY_S)
    raise AveragingError(f"stage {stage}: could not fetch the result of step {round_id}: {last}")
