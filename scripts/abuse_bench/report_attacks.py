"""Member attacks through the coordinator's reports: role claims, liveness claims, and ban evasion (issue 27, attacks 2, 3, 6).

Each runs against :mod:`.swarm_target` while its honest swarm trains, with fresh identities the coordinator placed
(:class:`~.crew.Crew`); each Sybil is a replica that otherwise behaves honestly, so no commit waits on it. The
honest target of every accusation is ``h1a``, an honest stage-1 replica.

- ``role_claims``: the Sybils heartbeat the stage they were not assigned (``stage`` in the heartbeat, which only
  says which stage a node serves), ask the coordinator whom to ask to recompute ``h1a``'s output of a ticket
  (``coord.witness_draw``), and file integrity evidence against ``h1a``: its real signed backward output (the
  bench's last stage signs it for any stage-0 peer that sends it the ticket, as a node does) and the Sybils'
  signed "recomputations", which agree with each other and not with it. Outcome: every draw names only live
  replicas the coordinator assigned to stage 1, every such report is refused, ``h1a`` is never banned.
- ``liveness_reports``: the Sybils report ``h1a`` for lost microbatches (``liveness:``, 3 in a row) and send notices
  (1 lost) five times a second. A ban needs at least two live replicas of stage 0 that are a strict majority of it
  *and* no completion routed through ``h1a`` since the reports began; the Sybils hold what placement gave them,
  a minority of stage 0. Each report flags ``h1a`` (``lost_microbatches``: a claim, shown, never a ban) and makes it
  a routing suspect until it carries a ticket; outcome: ``h1a`` is never banned and trains on.
- ``ban_evasion``: a Sybil of stage 0 reports a colluding stage-1 Sybil with a NaN output it signed (evidence on its
  own), which bans it; the banned key then keeps asking (heartbeats, joins) and fresh keys join from its address.
  Outcome: every request of the banned key is refused. Over loopback the coordinator's cool-down for new keys from
  a banned address does not apply (loopback is exempt: every node on the coordinator's machine is its operator's),
  so here only the banned key itself is refused; the cool-down is tested in ``tests/unit/test_ban_cooldown.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import trio

from protolearn.node.coordinator_link import CoordinatorRefused
from protolearn.protocol import coordination as cm
from protolearn.protocol.boundary import OutputEvidence, SignedOutput, boundary_statement, frame_digest, inputs_digest
from protolearn.protocol.errors import ProtocolError, Refused
from protolearn.protocol.tensors import to_frame

from abuse_bench.crew import Crew, seen
from abuse_bench.harness import Sizes, Target, honest_step, measure
from abuse_bench.stand_ins import boundary_frames
from abuse_bench.swarm import LAST_STAGE, Lies, Replica
from abuse_bench.swarm_target import honest_charged

REPORTS_PER_S = 5
# Rounds of framing evidence (one report per Sybil each) per second: the attack is the witnesses, not the load.
FRAMINGS_PER_S = 1


class RoleLies(Lies):
    """Heartbeats the stage it was not assigned (while ``active``)."""

    def __init__(self) -> None:
        self.active = False

    def heartbeat(self, hb: cm.Heartbeat) -> cm.Heartbeat:
        return hb.model_copy(update={"stage": 1 - hb.stage}) if self.active and hb.stage in (0, 1) else hb


def _code(err: ProtocolError) -> str:
    if isinstance(err, CoordinatorRefused):
        return err.code
    text = err.reason
    return text[len("Refusal: "):].split(":", 1)[0] if text.startswith("Refusal: ") else type(err).__name__


async def _ask(r: Replica, msg: Any, reply_type: Any) -> Any:
    """One request of ``r``'s identity to the coordinator, without the link's retries: the reply, the refusal's code,
    or ``unreachable`` (its connection refused, e.g. a banned or temporarily banned peer's)."""
    try:
        return await r.host.request(r.link.peer, cm.COORDINATOR, msg, reply_type, timeout=10)
    except Refused as err:
        return _code(err)
    except ProtocolError:
        return "unreachable"


async def _framing_evidence(reporter: Replica, witnesses: list[Replica], accused: str, step: int, ticket: int,
                            outputs_of: dict[tuple[int, int], tuple[bytes, Any, Any]]) -> OutputEvidence:
    """``accused``'s real signed backward output of (step, ticket) (asked for once: ``outputs_of`` keeps it) and the
    ``witnesses``' signed made-up ones."""
    if (step, ticket) not in outputs_of:
        done = await reporter.work(accused, step, ticket, b"", output=True)
        act, grad = await trio.to_thread.run_sync(boundary_frames, step, ticket, reporter.boundary_shape)
        outputs_of[(step, ticket)] = (done.output_signature, act, grad)
    signature, act, grad = outputs_of[(step, ticket)]
    inputs = inputs_digest([act])
    made_up = to_frame(torch.zeros(reporter.boundary_shape))  # the Sybils agree with each other, not with the accused
    outputs = [SignedOutput.of(accused, signature, grad)]
    for w in witnesses:
        statement = boundary_statement(reporter.link.joined.run_hash, step, ticket, "bwd", LAST_STAGE, inputs, frame_digest(made_up))
        outputs.append(SignedOutput.of(w.me, w.host.sign(statement), made_up))
    return OutputEvidence(accused=accused, step=step, ticket=ticket, direction="bwd", stage=LAST_STAGE, inputs=inputs, outputs=outputs)


async def report_rows(target: Target, ready: dict, sizes: Sizes, run: Any) -> dict[str, dict]:
    honest = [h["id"] for h in ready["honest"].values()]
    accused = ready["honest"]["h1a"]["id"]

    step = honest_step(target)

    rows: dict[str, dict] = {}

    # -- role claims and chosen witnesses ---------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    lies = RoleLies()
    seen_draws: list[list[str]] = []
    refusals: dict[str, int] = {}
    convictions = [0]
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        sybils = [await crew.replica(f"claimer-{k}", lies=lies) for k in range(sizes.role_sybils)]
        await seen(target, [s.me for s in sybils])

        async def claim_roles(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            lies.active = True
            for s in sybils:
                s.link.beat_now()
            await trio.sleep(1.5)  # their next heartbeats carry the claim
            task_status.started()
            ticket = 0
            outputs_of: dict[tuple[int, int], tuple[bytes, Any, Any]] = {}
            try:
                while True:
                    frontier = sybils[0].link.step
                    ticket = (ticket + 1) % run.batch.microbatches_per_step
                    for key in [key for key in outputs_of if key[0] < frontier - 1]:
                        del outputs_of[key]
                    for k, reporter in enumerate(sybils):
                        draw = await _ask(reporter, cm.WitnessDraw(target=accused, step=frontier, ticket=ticket, direction="bwd"),
                                          cm.WitnessDrawReply)
                        if isinstance(draw, cm.WitnessDrawReply):
                            seen_draws.append(list(draw.witnesses))
                        others = [w for j, w in enumerate(sybils) if j != k]
                        try:
                            ev = await _framing_evidence(reporter, others, accused, frontier, ticket, outputs_of)
                        except ProtocolError:
                            continue
                        reply = await _ask(reporter, cm.IntegrityReport(target=accused, reason="integrity: spot check mismatch", evidence=ev),
                                           cm.ReportReply)
                        if isinstance(reply, cm.ReportReply):
                            convictions[0] += int(reply.banned)
                            refusals["accepted"] = refusals.get("accepted", 0) + 1
                        else:
                            refusals[reply] = refusals.get(reply, 0) + 1
                    await trio.sleep(1 / FRAMINGS_PER_S)
            finally:
                lies.active = False

        row = await measure(target, {"step": step}, sizes.steps, 0.0, claim_roles, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record")
        claimers = {s.me for s in sybils}
    assigned1 = {p for p, r in rec["peers"].items() if r["stage"] == LAST_STAGE and r["status"] == "live"}
    stray = [d for d in seen_draws if not set(d) <= assigned1 - claimers - {accused}]
    charged = honest_charged(rec0, rec, honest)
    rows["role_claims"] = {**row, "honest_ok": row["honest_ok"] and not charged and not stray and not convictions[0] and "accepted" not in refusals,
                           "draws": len(seen_draws), "draws_naming_a_claimer": len(stray), "evidence_refused": refusals,
                           "honest_charged": charged,
                           "outcome": f"{len(seen_draws)} draws, {len(stray)} naming a claimer; evidence refused "
                                      f"{', '.join(f'{k} {v}' for k, v in refusals.items()) or 'never filed'}; no conviction"}

    # -- liveness claims -------------------------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    sent = {"reports": 0, "notices": 0, "banned_replies": 0}
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        sybils = [await crew.replica(f"reporter-{k}") for k in range(sizes.report_sybils)]
        await seen(target, [s.me for s in sybils])

        async def report_lost(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                for s in sybils:
                    for lost, kind in ((3, "reports"), (1, "notices")):
                        reply = await _ask(s, cm.Report(target=accused, reason=f"liveness: lost {lost} microbatches in a row", lost=lost),
                                           cm.ReportReply)
                        sent[kind] += 1
                        if isinstance(reply, cm.ReportReply) and reply.banned:
                            sent["banned_replies"] += 1
                await trio.sleep(1 / REPORTS_PER_S)

        row = await measure(target, {"step": step}, sizes.steps, 0.0, report_lost, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record")
        in0 = sum(1 for s in sybils if rec["peers"][s.me]["stage"] == 0)
    target_rec = rec["peers"][accused]
    charged = honest_charged(rec0, rec, honest, claims=("lost_microbatches",))
    rows["liveness_reports"] = {**row, "honest_ok": row["honest_ok"] and not charged and not target_rec["banned"] and not sent["banned_replies"],
                                **sent, "sybils_in_stage0": in0, "stage0_replicas": rec["working"][0], "target_flags": target_rec["flags"],
                                "honest_charged": charged,
                                "outcome": f"{sent['reports']} reports, {sent['notices']} notices from {in0} of {rec['working'][0]} stage-0 replicas; "
                                           f"target {'banned' if target_rec['banned'] else 'never banned'} ({', '.join(target_rec['flags'])})"}

    # -- a ban, then evasion ------------------------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    asked = {"banned_key_refused": 0, "banned_key_answered": 0, "new_keys_admitted": 0}
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        convict = await crew.land_in(LAST_STAGE, "convict")
        reporter = next(r for r in crew.replicas if r.stage == 0) if any(r.stage == 0 for r in crew.replicas) else await crew.land_in(0, "reporter")
        await seen(target, [convict.me])
        ban_reason = [""]

        async def evade(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            frontier = (await target.ask("record", peers=[]))["step"]
            act, _ = await trio.to_thread.run_sync(boundary_frames, frontier, 0, convict.boundary_shape)
            nan = to_frame(torch.full(convict.boundary_shape, float("nan")))
            statement = boundary_statement(convict.link.joined.run_hash, frontier, 0, "bwd", LAST_STAGE, inputs_digest([act]), frame_digest(nan))
            ev = OutputEvidence(accused=convict.me, step=frontier, ticket=0, direction="bwd", stage=LAST_STAGE, inputs=inputs_digest([act]),
                                outputs=[SignedOutput.of(convict.me, convict.host.sign(statement), nan)])
            reply = await _ask(reporter, cm.IntegrityReport(target=convict.me, reason="integrity: NaN output", evidence=ev), cm.ReportReply)
            ban_reason[0] = reply.reason if isinstance(reply, cm.ReportReply) and reply.banned else f"not banned: {reply}"
            task_status.started()
            addrs = [a.rsplit("/p2p/", 1)[0] for a in convict.host.addrs()]
            k = 0
            while True:
                for msg, reply_type in ((cm.Heartbeat(state="training", stage=LAST_STAGE), cm.HeartbeatReply),
                                        (cm.Join(addrs=addrs, throughput=100.0, name="convict"), cm.JoinReply)):
                    got = await _ask(convict, msg, reply_type)  # "unreachable": refused at the connection, after the ban's notice
                    asked["banned_key_refused" if got in ("banned", "unreachable") else "banned_key_answered"] += 1
                k += 1
                if k % 5 == 1:  # a fresh key from the same address
                    try:
                        await crew.member(f"evader-{k}")
                        asked["new_keys_admitted"] += 1
                    except ProtocolError:
                        pass
                await trio.sleep(0.2)

        row = await measure(target, {"step": step}, sizes.steps, 0.0, evade, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record", peers=[*honest, convict.me])
    charged = honest_charged(rec0, rec, honest)
    banned = bool(rec["peers"][convict.me]["banned"])
    rows["ban_evasion"] = {**row, "honest_ok": row["honest_ok"] and not charged and banned and not asked["banned_key_answered"],
                           **asked, "convict_banned": ban_reason[0][:120], "honest_charged": charged,
                           "loopback": "new keys from a banned address are exempt from the cool-down on loopback",
                           "outcome": f"banned key refused {asked['banned_key_refused']} times, answered {asked['banned_key_answered']}; "
                                      f"{asked['new_keys_admitted']} new keys from its (loopback) address admitted"}
    return rows
