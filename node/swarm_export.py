"""Export from a live swarm: fetch every stage's parameters from a live replica and write one model file.

:func:`export_swarm` asks the coordinator for its run and live membership (``coord.members``), then
fetches each stage's parameters from one of its live replicas over the state-sync protocol
(:func:`~protolearn.node.state_sync.fetch_state`: the same validation a joining replica applies, by
name, dtype, shape and finiteness). It takes the parameters alone, a third of a state's bytes (no optimizer
state), yet a replica's word is not enough: the digests it announces for its whole state must add up to the
hash it claims, that hash must be, by a joiner's rule (:func:`~protolearn.node.syncing.judge_state`), what a
strict majority of the stage's replicas reported to the coordinator (judged before a tensor is taken), and
each parameter must match its digest, so one lying replica cannot hand over the exported model (nor the final
model the coordinator keeps and serves, which it fetches this way). All
stages are fetched concurrently, one at a time from each peer; because the swarm keeps training, the stages can answer at different
steps, so stages behind the newest are fetched again until every stage is at one step (or
``timeout_s`` passes). The parameters are then written with :func:`~protolearn.node.export.write_model`:
one safetensors file plus ``<name>.toml``, the same format as ``protolearn export``.

The exporter is not a member: it only talks to the coordinator and to replicas' state servers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import trio
from protolearn.node.coordinator_link import coordinator_peer_id
from protolearn.node.errors import NodeError, StateSyncError
from protolearn.node.export import ExportResult, write_model
from protolearn.node.state_sync import fetch_state
from protolearn.node.syncing import judge_state
from protolearn.node.worker import StageWorker
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.transport import Host
from protolearn.stages.config import RunConfig
from protolearn.stages.stage import build_stage

log = logging.getLogger("protolearn.node")

# Rounds of re-fetching stages that answered at an older step than the others.
MAX_ROUNDS = 20
# A fetched stage's state waits for its replicas' reports of that step (up to the fetch's timeout: a report comes
# with the heartbeat after a replica applied the step); asked again after JUDGE_POLL_S, then at twice the pause up to 1 s.
JUDGE_POLL_S = 0.1


class ExportError(NodeError):
    """The swarm could not be exported: a stage has no live replica, or its replicas kept failing."""


def _stages_phrase(stages: list[int]) -> str:
    """"stage 1 has" or "stages 0 and 1 have" (or "stages 0, 1 and 2 have")."""
    if len(stages) == 1:
        return f"stage {stages[0]} has"
    return f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]} have"


async def fetch_members(host: Host, coordinator: str, *, timeout_s: float) -> cm.Members:
    reply = await host.request(coordinator, cm.COORDINATOR, cm.MembersRequest(), cm.Members, timeout=timeout_s)
    if not isinstance(reply, cm.Members):
        raise ExportError(f"the coordinator answered {type(reply).__name__} to a membership request")
    return reply


async def _fetch_stage(
    host: Host, coordinator: str | None, worker: StageWorker, replicas: list[str], run_hash: str, timeout_s: float,
    one_at_a_time: dict[str, trio.Lock],
) -> tuple[int, dict[str, torch.Tensor]]:
    """(applied, parameters) of one stage from the first replica that hands over the stage's state (the module
    docstring); ``coordinator`` None: the source is the coordinator's own kept model, which needs no majority.
    One fetch per peer at a time (``one_at_a_time``, a lock per peer): a state server takes at most two streams
    from one peer, and the coordinator's kept model serves every stage."""

    async def check(peer: str, applied: int, claimed: str) -> None:
        """The replica's claim must be the stage's (a state after 0 steps the run's init: hashed only then, every
        stage's init would cost seconds at scale); judged before a tensor is taken."""
        if coordinator is None:
            return
        init = await trio.to_thread.run_sync(lambda: build_stage(worker.run, worker.stage).state_hash()) if applied == 0 else ""
        verdict, why = await _judge(host, coordinator, worker.stage, applied, claimed, init, timeout_s)
        if verdict != "ok":
            raise StateSyncError(f"refused: {why}")

    last = "no replica tried"
    for peer in replicas:
        try:
            async with one_at_a_time.setdefault(peer, trio.Lock()):
                # The parameters alone, each matching its digest among those of the whole state, whose hash is the stage's.
                applied, _, entries, _ = await fetch_state(host, peer, worker, run_hash, timeout_s=timeout_s, check=check, params_only=True)
        except (ProtocolError, StateSyncError) as err:
            last = f"{peer}: {err}"
            log.warning("export: fetching stage %d from %s failed: %s", worker.stage, peer, err)
            continue
        return applied, {n: entries[f"param/{n}"] for n in worker.names}
    raise ExportError(f"could not fetch stage {worker.stage} from any of its {len(replicas)} live replicas ({last})")


async def _judge(host: Host, coordinator: str, stage: int, applied: int, got: str, init_hash: str, timeout_s: float) -> tuple[str, str]:
    """:func:`judge_state` on the hashes ``stage``'s replicas reported, asked again while it cannot tell yet, for
    up to ``timeout_s``: the replicas report a step's hash in the heartbeat after they applied it, and the final
    model is fetched as soon as the last step commits."""
    verdict, why = "wait", "no answer"
    deadline, pause = trio.current_time() + timeout_s, JUDGE_POLL_S
    while True:
        try:
            reply = await host.request(coordinator, cm.COORDINATOR, cm.StageHashesRequest(stage=stage), cm.StageHashes, timeout=timeout_s)
        except ProtocolError as err:
            verdict, why = "wait", f"the coordinator did not give the stage's hashes ({err.reason})"
        else:
            if not isinstance(reply, cm.StageHashes):
                raise ExportError(f"the coordinator answered {type(reply).__name__} to a stage hashes request")
            reported = [(ph.peer_id, ph.step, ph.hash) for ph in reply.param_hashes]
            verdict, why = judge_state(applied, got, reported, frontier=reply.step, init_hash=init_hash)
        if verdict != "wait":
            return verdict, why
        if trio.current_time() + pause > deadline:
            return verdict, f"{why}; nothing to check its state against"
        await trio.sleep(pause)
        pause = min(2 * pause, 1.0)


async def export_swarm(host: Host, coordinator: str, out: str | Path, *, timeout_s: float = 60.0) -> ExportResult:
    """Fetch every stage's current parameters from live replicas and write them as one model file."""
    try:
        with trio.fail_after(timeout_s):
            return await _export(host, coordinator, Path(out), timeout_s)
    except trio.TooSlowError:
        raise ExportError(f"the swarm export did not finish within {timeout_s:g} s; the swarm kept moving or a replica stalled, try again or raise --timeout") from None


async def _export(host: Host, coordinator: str, out: Path, timeout_s: float) -> ExportResult:
    try:
        members = await fetch_members(host, coordinator, timeout_s=timeout_s)
    except ProtocolError as err:
        raise ExportError(f"cannot get the membership from the coordinator at {coordinator}: {err.reason}; check the address and that it runs") from None
    run = RunConfig.from_toml_text(members.run_toml, source="the coordinator's run config")
    if run.run_hash() != members.run_hash:
        raise ExportError(f"the coordinator's run hash {members.run_hash[:12]} does not match its run config; it runs another protolearn version")
    num_stages = run.stages.num_stages
    by_stage = {s: sorted(m.peer_id for m in members.members if m.stage == s and m.state.live) for s in range(num_stages)}
    kept_model = members.final_step >= 0 and not any(by_stage.values())
    if kept_model:
        # The run finished and its nodes left: the coordinator serves the final model it kept.
        by_stage = {s: [coordinator_peer_id(coordinator)] for s in range(num_stages)}
    empty = [s for s, peers in by_stage.items() if not peers]
    if empty:
        raise ExportError(
            f"{_stages_phrase(empty)} no live replica, so {'its' if len(empty) == 1 else 'their'} parameters cannot be fetched; "
            "export from the nodes' checkpoints instead: gather every stage's stage-<s>-step-<t>.safetensors (from each node's "
            "<data dir>/checkpoints) into one folder and run `protolearn export --checkpoints DIR`"
        )
    for m in members.members:
        if m.addrs:
            try:
                host.add_peer_addrs(m.peer_id, m.addrs)
            except ProtocolError as err:
                log.warning("export: ignored member address peer=%s reason=%s", m.peer_id, err.reason)
    workers = [await trio.to_thread.run_sync(StageWorker, run, s) for s in range(num_stages)]
    judge_with = None if kept_model else coordinator
    locks: dict[str, trio.Lock] = {}
    got: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    todo = list(range(num_stages))
    for _ in range(MAX_ROUNDS):

        async def one(s: int) -> None:
            got[s] = await _fetch_stage(host, judge_with, workers[s], by_stage[s], members.run_hash, timeout_s, locks)

        async with trio.open_nursery() as nursery:
            for s in todo:
                nursery.start_soon(one, s)
        newest = max(applied for applied, _ in got.values())
        todo = [s for s, (applied, _) in got.items() if applied < newest]
        if not todo:
            break
        log.info("export: stages %s are behind step %d; fetching them again", todo, newest)
    else:
        shown = ", ".join(f"stage {s}: {a}" for s, (a, _) in sorted(got.items()))
        raise ExportError(f"the stages never answered at one step ({shown}); the swarm may be stuck mid-step, try again")
    params = {n: t for _, (_, p) in sorted(got.items()) for n, t in p.items()}
    step = next(iter(got.values()))[0]
    return await trio.to_thread.run_sync(lambda: write_model(params, run, step, out))
