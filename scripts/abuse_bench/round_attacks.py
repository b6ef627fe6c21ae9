"""Member attacks on a stage's collective: one of a stage's three replicas lies to the other two (issue 27, attack 1).

The liar is a fresh identity the coordinator placed in stage 1 (the attacker joins identities until one lands
there, :meth:`~.crew.Crew.land_in`), next to the honest ``h1a`` and ``h1b`` of :mod:`.swarm_target`. It is a
full replica (the stage-0 replicas route tickets through it, so it is a participant of every stage-1 round) and
behaves honestly while the rows' baselines are timed; under attack its collective messages lie:

- ``round_suspicion``: every message it sends (parts, probes, fins) names the receiver and every other
  participant as dead (``suspects``, an unsigned claim), and it probes each honest replica ten times a second
  with the same claim. One claimant never fails a round (``max_liars``): the receiver only probes the peers named.
- ``round_fin_liar``: it signs fins that leave every honest participant out. Such a fin fails the receiver's
  round at once, with the fin as evidence of whose word ended it; both honest replicas then ask for the step to
  be redone naming the liar (``round_failed``), the coordinator charges the liar once a strict majority of the
  stage's participants named it (``round_fault``) and stage 0 routes none of the step through it, so the step
  closes again without it and the honest replicas finish it.

Honest operation: one training step of the honest swarm. ``honest_ok`` needs every step applied by every honest
replica with the step's every ticket once and identical replicas (:mod:`.swarm_target`), no honest replica
flagged or banned by the coordinator, and for the fin liar, the liar charged with ``round_fault``.
"""

from __future__ import annotations

from typing import Any

import trio

from protolearn.protocol.collective import PartHeader
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse, ResultServed
from protolearn.protocol.statements import fin_statement, members_mask, op_tag, round_digest
from protolearn.protocol.wire import Message

from abuse_bench.crew import Crew, seen
from abuse_bench.harness import Sizes, Target, honest_step, measure
from abuse_bench.swarm import LAST_STAGE, Lies, Replica
from abuse_bench.swarm_target import honest_charged

PROBES_PER_S = 10


class SuspectLies(Lies):
    """Names every other participant, the receiver included, dead in each collective message (while ``active``)."""

    def __init__(self) -> None:
        self.active = False
        self.told = 0

    def collective(self, me: Replica, peer: str, msg: Message) -> Message:
        weights = me.averager.weights.get(msg.round) if isinstance(msg, PartHeader) else None
        if not self.active or weights is None or peer not in weights:
            return msg
        self.told += 1
        return msg.model_copy(update={"suspects": sorted((set(msg.suspects) | set(weights)) - {me.me})})


class FinLies(Lies):
    """Signs each fin it sends over itself alone, leaving every other participant out, and says its round failed
    to a replica that asks for the result (while ``active``)."""

    def __init__(self) -> None:
        self.active = False
        self.fins = 0
        self.refused = 0

    def collective(self, me: Replica, peer: str, msg: Message) -> Message:
        if self.active and isinstance(msg, ResultServed):
            self.refused += 1
            return Refuse(code="left", reason="the round failed here: it has no result")
        weights = me.averager.weights.get(msg.round) if isinstance(msg, PartHeader) else None
        if not self.active or weights is None or msg.phase != "fin" or msg.vetoed:
            return msg
        tag = op_tag("sum", me.averager.aggregation.tag, me.averager.cross_check)
        digest = round_digest(msg.round, weights, me.numel, tag)
        alone = [me.me]
        signature = me.host.sign(fin_statement(digest, members_mask(sorted(weights), alone), msg.digest))
        self.fins += 1
        return msg.model_copy(update={"contributors": alone, "signature": signature})


async def _probe(liar: Replica, honest: list[str], sent: list[int]) -> None:
    """Probe each honest replica of the liar's current round with the claim that it and the others are dead."""
    while True:
        weights = liar.averager.weights.get(liar.core.next_round, {})
        for peer in set(honest) & set(weights):
            msg = PartHeader(round=liar.core.next_round, stage=LAST_STAGE, phase="probe", part=0, suspects=sorted(set(weights) - {liar.me}))
            try:
                async with liar.host.open_stream(peer, COLLECTIVE) as s:
                    await s.send(msg)
                    await s.receive((Ack, Refuse, PartHeader), timeout=5)
                sent[0] += 1
            except ProtocolError:
                pass
        await trio.sleep(1 / PROBES_PER_S)


async def round_rows(target: Target, ready: dict, sizes: Sizes, run: Any) -> dict[str, dict]:
    honest = [h["id"] for h in ready["honest"].values()]
    stage1 = [h["id"] for h in ready["honest"].values() if h["stage"] == LAST_STAGE]
    steps: list[dict] = []

    step = honest_step(target, steps)

    rows: dict[str, dict] = {}

    # -- unsigned suspicions -----------------------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    lies = SuspectLies()
    probes = [0]
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        liar = await crew.land_in(LAST_STAGE, "suspect-liar", lies=lies)
        await seen(target, [liar.me])

        async def suspicion(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            lies.active = True
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(_probe, liar, stage1, probes)
                    task_status.started()
            finally:
                lies.active = False

        row = await measure(target, {"step": step}, sizes.steps, 0.0, suspicion, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record", peers=[liar.me, *honest])
    charged = honest_charged(rec0, rec, honest)
    rows["round_suspicion"] = {**row, "honest_ok": row["honest_ok"] and not charged, "messages_lying": lies.told, "probes": probes[0],
                               "honest_charged": charged, "liar_flags": rec["peers"][liar.me]["flags"],
                               "outcome": f"{lies.told} messages and {probes[0]} probes named the receiver dead; rounds finished, nobody charged"}

    # -- fins that leave the honest replicas out ---------------------------------------------------------
    rec0 = await target.ask("record", peers=honest)
    fin_lies = FinLies()
    async with Crew(ready["coord"], run, sizes.swarm_numel) as crew:
        liar = await crew.land_in(LAST_STAGE, "fin-liar", lies=fin_lies)
        await seen(target, [liar.me])
        before = len(steps) + (1 if sizes.swarm_warm_up else 0)

        async def lying_fins(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            fin_lies.active = True
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                fin_lies.active = False

        row = await measure(target, {"step": step}, sizes.steps, 0.0, lying_fins, op_timeout_s=150, warm_up=sizes.swarm_warm_up)
        rec = await target.ask("record", peers=[liar.me, *honest])
        under = steps[before + sizes.steps:]  # the baseline came first
    charged = honest_charged(rec0, rec, honest)
    liar_rec = rec["peers"][liar.me]
    rows["round_fin_liar"] = {**row, "honest_ok": row["honest_ok"] and not charged, "lying_fins": fin_lies.fins,
                              "results_refused": fin_lies.refused,
                              "closings_under_attack": [s["closings"] for s in under], "honest_charged": charged,
                              "liar_flags": liar_rec["flags"], "liar_banned": liar_rec["banned"],
                              "outcome": f"{fin_lies.fins} lying fins, {fin_lies.refused} results refused; steps closed {'/'.join(str(s['closings']) for s in under)} "
                                         f"times; liar {', '.join(liar_rec['flags']) or 'not struck'}{' and banned' if liar_rec['banned'] else ''}"}
    return rows
