"""Member attacks on the coordinator's own decisions: placement, completions, long polls (issue 27, attacks 4, 5, 7).

Each runs against :mod:`.swarm_target` while its honest swarm trains, with fresh identities (:class:`~.crew.Crew`).

- ``stage_steering``: identities join, and those the coordinator did not place in stage 1 leave again and are
  replaced by fresh ones, to crowd stage 1 (one is kept in stage 0 first: with fewer than three replicas in the
  least loaded stage, stages are filled in order, and no draw can put anyone in stage 1). It runs twice: with
  identities that claim the honest replicas' throughput, and with identities that claim almost none (such claims
  never move a stage's throughput, which once kept stage 1 in every draw). Outcome: no identity is placed in stage 1
  while stage 1 holds more than the balancer's slack over stage 0 (``replicas_1 > (1 + PLACEMENT_SLACK) *
  replicas_0`` just before the join, by the coordinator's own record), and an honest joiner is placed as the rule
  says.
- ``ack_replay``: a stage-0 Sybil that carries tickets as an honest replica does redoes its own tickets after every
  first closing (a redo of its own tickets is its right, e.g. after losing their gradients), so the step reopens;
  under attack it then leases them again and first completes each with the ack of its earlier lease (and
  that ack with the new lease's nonce) before doing the work. Outcome: every replayed ack is refused and the step
  closes again with the ticket's new completion, counted once.
- ``long_poll_slots``: Sybil members that serve nothing (they heartbeat ``syncing``) each hold 16 long polls (the
  transport's per-peer stream cap) that no step change answers, and open a new one as each ends; 5 of them hold
  80, more than the target's 64 slots. The honest replicas' own long polls ("has the step closed?", "did it
  commit or reopen?") must get answers within their deadlines, never a ``busy`` read as "no": outcome, every
  honest step applied in time.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import trio

from protolearn.coordinator.core.assignment import PLACEMENT_SLACK
from protolearn.node.coordinator_link import CoordinatorRefused
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.states import NodeState

from abuse_bench.crew import Crew, Member, seen
from abuse_bench.harness import Sizes, Target, honest_step, measure, quiet
from abuse_bench.swarm import LAST_STAGE, LEASE_POLL_S
from abuse_bench.swarm_target import honest_charged

log = logging.getLogger("protolearn.bench")

HONEST_CLAIM = 100.0  # what the honest replicas of swarm_target claim
LOW_CLAIM = 1e-3
POLLS_PER_SYBIL = 16


def _over_slack(placement: dict) -> bool:
    """Whether a joiner was placed in stage 1 while stage 1 already held more than the balancer's slack over stage 0
    (the coordinator's loads just before the join)."""
    r0, r1 = placement["before"][0]["replicas"], placement["before"][1]["replicas"]
    return placement["stage"] == LAST_STAGE and r1 > (1 + PLACEMENT_SLACK) * r0


async def _steer(target: Target, crew: Crew, tries: int, claim: float, log: list[dict], joins: trio.Lock) -> int:
    """Crowd stage 1 (see the module docstring); how many identities the attacker holds there at the end. Each join
    and the loads after it are taken under ``joins`` (the honest joiner's turns come in between)."""
    kept: list[Member] = []
    opened = False
    for k in range(tries):
        async with joins:
            before = (await target.ask("record", peers=[]))["loads"]
            try:
                m = await crew.member(f"steer-{claim:g}-{k}", throughput=claim, state=NodeState.SYNCING)
            except ProtocolError:  # refused (e.g. over its rate): the next identity tries
                continue
            log.append({"stage": m.reply.stage, "before": before, "loads": (await target.ask("record", peers=[]))["loads"]})
            if m.reply.stage == LAST_STAGE or not opened:
                opened = opened or m.reply.stage != LAST_STAGE
                kept.append(m)
            else:
                await m.leave()
    return sum(1 for m in kept if m.reply.stage == LAST_STAGE)


async def coordinator_rows(target: Target, ready: dict, sizes: Sizes, run: Any) -> dict[str, dict]:
    honest = [h["id"] for h in ready["honest"].values()]
    coord_id = ready["coord"].rsplit("/p2p/", 1)[1]
    errors = quiet()

    step = honest_step(target)

    rows: dict[str, dict] = {}

    # -- stage steering ---------------------------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    placements: list[dict] = []
    held = [0]
    steered = trio.Event()
    joins = trio.Lock()
    misplaced: list[str] = []
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        async def fresh_join() -> bool:
            # An honest joiner: it must be placed as the rule says, whatever the Sybils did (then it leaves).
            async with joins:
                before = (await target.ask("record", peers=[]))["loads"]
                m = await crew.member("fresh", throughput=HONEST_CLAIM)
                await m.leave()
            least = min((0, 1), key=lambda s: (before[s]["throughput"], before[s]["replicas"], s))
            near = [s for s in (0, 1) if before[s]["replicas"] and before[s]["throughput"] <= before[least]["throughput"] * (1 + PLACEMENT_SLACK)]
            ok = m.reply.stage == least or (before[least]["replicas"] >= 3 and m.reply.stage in near)
            if not ok:
                misplaced.append(f"stage {m.reply.stage} with loads {before}: {m.reply.reason}")
                print(f"honest joiner placed in {misplaced[-1]}", file=sys.stderr)
            return ok

        async def steer(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            held[0] = await _steer(target, crew, sizes.steering_tries, HONEST_CLAIM, placements, joins)
            steered.set()
            await trio.sleep_forever()

        row = await measure(target, {"step": step, "join": fresh_join}, sizes.steps, 0.0, steer, op_timeout_s=150, warm_up=sizes.swarm_warm_up,
                            until=steered)
    low_log: list[dict] = []
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        low_held = await _steer(target, crew, sizes.steering_tries, LOW_CLAIM, low_log, trio.Lock())
    charged = honest_charged(rec0, await target.ask("record", peers=honest), honest)
    over = [p for p in placements + low_log if _over_slack(p)]
    last = low_log[-1]["loads"] if low_log else [{"replicas": 0}, {"replicas": 0}]
    rows["stage_steering"] = {**row, "honest_ok": row["honest_ok"] and not over and not charged, "joins": len(placements),
                              "sybils_held_in_stage1": held[0], "honest_charged": charged, "honest_joins_misplaced": misplaced,
                              "placements_over_slack": len(over), "stage_replicas_after": placements[-1]["loads"] if placements else [],
                              "low_claims": {"joins": len(low_log), "sybils_held_in_stage1": low_held,
                                             "stage_replicas_after": [last[0]["replicas"], last[1]["replicas"]]},
                              "outcome": f"{held[0]} Sybils held in stage 1 after {len(placements)} joins; claiming {LOW_CLAIM:g} throughput, "
                                         f"{low_held} after {len(low_log)} (stages {last[0]['replicas']} / {last[1]['replicas']} replicas); "
                                         f"{len(over)} placements over the slack"}

    # -- ack replay on a reopened step -----------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    replay = {"active": False, "tried": 0, "refused_bad_ack": 0, "refused_other": 0, "accepted": 0, "reopened": 0, "lease_lost": 0}
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        a = await crew.land_in(0, "replayer", leases=True)
        a.closed_poll_s = LEASE_POLL_S  # it asks for the next step's tickets as soon as they are leasable
        await seen(target, [a.me])

        replayed = trio.Event()  # a replay reached the ack check: it held the ticket's current lease

        async def complete(msg: cm.Complete) -> None:
            replay["tried"] += 1
            replayed.set()
            try:
                await a.link.complete(msg.step, msg.index, msg.route, msg.loss, msg.ack, msg.nonce)
                replay["accepted"] += 1
            except CoordinatorRefused as err:
                replay["refused_bad_ack" if err.code == "bad_ack" else "refused_other"] += 1
            except ProtocolError:  # unanswered: not accepted either
                replay["refused_other"] += 1

        async def redo(step: int, tickets: list[int], n: trio.Nursery) -> None:
            try:
                await a.link.redo(step, tickets, "lost the tickets' gradients", revision=1, kind="lost_gradients")
                replay["reopened"] += 1
            except ProtocolError as err:
                log.info("replayer: redo of step %d refused: %s", step, err.reason)
                n.cancel_scope.cancel()

        async def grab(step: int, n: int, got: dict[int, bytes]) -> None:
            """Lease the redone tickets of ``step`` as soon as they are free (for at most a second).

            A lease request is never cancelled midway: the coordinator may have granted it, and a grant whose answer
            was dropped would sit unclaimed until the lease ran late (10 s), holding the honest swarm's next step
            (a bench artefact, not the attack; it once failed CI's run by passing the step's 20 s deadline)."""
            end = trio.current_time() + 1.0
            while not got and trio.current_time() < end:
                with trio.CancelScope(shield=True):  # (each request has its own deadline)
                    lease = await a.link.lease(n)
                    if lease.step == step:
                        got.update(zip(lease.indices, lease.nonces, strict=True))
                    elif lease.indices:  # the next step's: not this attack's, and not to be sat on
                        await a.link.release(lease.step, lease.indices)
                await trio.sleep(0.002)

        async def redo_own(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            """After each first closing in which it carried tickets, redo them; under attack, replay their old acks first."""
            task_status.started()
            step = 0
            while True:
                try:
                    info = await a.link.wait_step(step, timeout_s=10)
                except ProtocolError:
                    await trio.sleep(0.5)
                    continue
                if not info.closed:
                    step = max(step, info.open_step)
                    continue
                mine = [t for sa in info.accounting if sa.stage == 0 for pt in sa.peers if pt.peer_id == a.me for t in pt.tickets]
                olds = [a.completed[(step, t)] for t in mine if (step, t) in a.completed]
                log.info("replayer: step %d closed at revision %d; its tickets %s", step, info.revision, mine)
                if info.revision == 1 and olds and not info.committed:
                    a.allow_leases(-1)  # these tickets are the attack's, not the driver's
                    try:
                        got: dict[int, bytes] = {}
                        async with trio.open_nursery() as n:  # its lease requests follow its redo at once
                            n.start_soon(grab, step, len(olds), got)
                            await redo(step, [o.index for o in olds], n)
                        nonces = {i: got[i] for i in (o.index for o in olds) if i in got}
                        replay["lease_lost"] += len(olds) - len(nonces)
                        for old in olds:
                            nonce = nonces.get(old.index)
                            if replay["active"] and nonce is not None:
                                await complete(old)  # the earlier lease's ack, as it was
                                await complete(old.model_copy(update={"nonce": nonce}))  # that ack, with this lease's nonce
                            if nonce is not None:
                                await a.carry(step, old.index, nonce)
                        for i in set(got) - set(nonces):
                            await a.carry(step, i, got[i])
                    except ProtocolError as err:
                        log.info("replayer: %s", err.reason)
                    finally:
                        a.allow_leases(None)
                step += 1

        async with trio.open_nursery() as background:
            await background.start(redo_own)

            async def replaying(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                replay["active"] = True
                try:
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    replay["active"] = False

            row = await measure(target, {"step": step}, sizes.steps, 0.0, replaying, op_timeout_s=150, warm_up=sizes.swarm_warm_up,
                                until=replayed)
            background.cancel_scope.cancel()
        rec = await target.ask("record", peers=honest)
    charged = honest_charged(rec0, rec, honest)
    rows["ack_replay"] = {**row, "honest_ok": row["honest_ok"] and not charged and not replay["accepted"] and replay["refused_bad_ack"] > 0,
                          **{k: v for k, v in replay.items() if k != "active"}, "honest_charged": charged,
                          "outcome": f"{replay['tried']} replays with the lease held: {replay['refused_bad_ack']} refused bad_ack, "
                                     f"{replay['accepted']} accepted; {replay['reopened']} reopenings"}

    # -- long-poll slots ---------------------------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    polls = {"held": 0, "busy": 0}
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        pollers = [await crew.member(f"poller-{k}", state=NodeState.SYNCING) for k in range(sizes.poll_sybils)]

        async def fill(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            # A step no change answers: step 0 at a revision it never reaches, until the poll's 30 s are up.
            never = cm.WaitStep(step=0, min_revision=2**30, timeout_s=cm.MAX_WAIT_S)

            async def hold(m: Member) -> None:
                while True:
                    try:
                        polls["held"] += 1
                        await m.host.request(coord_id, cm.COORDINATOR, never, cm.StepInfo, timeout=cm.MAX_WAIT_S + 10)
                    except errors:
                        polls["busy"] += 1
                        await trio.sleep(0.05)

            async with trio.open_nursery() as n:
                for m in pollers:
                    for _ in range(POLLS_PER_SYBIL):
                        n.start_soon(hold, m)
                await trio.sleep(1.0)  # the slots are taken
                task_status.started()

        row = await measure(target, {"step": step}, sizes.steps, 0.0, fill, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record", peers=honest)
    charged = honest_charged(rec0, rec, honest)
    rows["long_poll_slots"] = {**row, "honest_ok": row["honest_ok"] and not charged, "sybil_polls": polls["held"], "sybil_polls_refused": polls["busy"],
                               "honest_charged": charged,
                               "outcome": f"{sizes.poll_sybils} Sybils, {POLLS_PER_SYBIL} polls each; {polls['held']} polls, {polls['busy']} refused busy; "
                                          f"honest steps {'answered within the deadline' if row['honest_ok'] else 'not answered in time'}"}
    return rows
