"""The coordinator's integrity verdicts (coordinator/core/integrity.py): evidence it checks itself convicts,
nothing else does. Real cores, real Ed25519 keys, real tensors in real codec frames; a fake clock.

A spot check's evidence is the accused's signed output and those of the witnesses the coordinator drew for
the check (coordinator/core/witnesses.py), all of the same inputs; the accused is banned only if the
witnesses agree with each other within tolerance and it does not. A signed tensor with NaN convicts its
signer alone. A report without evidence is a flag, and nothing a reporter signs itself counts.
"""

from __future__ import annotations

import pytest
import torch
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.store import Store
from protolearn.protocol import coordination as cm
from protolearn.protocol.boundary import OutputEvidence, SignedOutput, boundary_statement, frame_digest
from protolearn.protocol.codecs import CodecContext, make_encoder
from protolearn.protocol.identity import Identity
from tests.support.coordinator import make_core

SHAPE = (2, 4, 8)
SETTINGS = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=1e6, lease_s=10.0, rate_per_s=1e6, rate_burst=1e6, rebalance_interval_s=1e9)
RUN = RunInfo(
    name="integrity", run_hash="cd" * 32, run_toml="", layers=(3, 1), microbatches_per_step=6, tokens_per_step=6 * 32,
    vocab_size=259, boundary_shape=SHAPE, codec="none", check_tolerance=1e-3,
)


class Swarm:
    """Joins real identities until stage 0 has ``n0`` replicas and stage 1 has one."""

    def __init__(self, core: CoordinatorCore, n0: int = 3) -> None:
        self.core = core
        self.ids: dict[str, Identity] = {}
        self.stage: dict[int, list[str]] = {0: [], 1: []}
        while len(self.stage[0]) < n0 or not self.stage[1]:
            ident = Identity.generate()
            reply = core.handle(ident.peer_id, cm.Join(addrs=["/ip4/127.0.0.1/tcp/9"], throughput=100.0), 0.0)
            self.ids[ident.peer_id] = ident
            self.stage[reply.stage].append(ident.peer_id)
            core.handle(ident.peer_id, cm.Heartbeat(state="training", stage=reply.stage), 0.1)  # it trains: a witness may be drawn

    def output(
        self, signer: str, t: torch.Tensor, *, step: int = 0, ticket: int = 1, codec: str = "none", inputs: bytes = b"", context: CodecContext | None = None,
    ) -> SignedOutput:
        frame, _ = make_encoder(codec).encode(t, context=context)
        statement = boundary_statement(self.core.run.run_hash, step, ticket, "fwd", 0, inputs, frame_digest(frame))
        return SignedOutput.of(signer, self.ids[signer].sign(statement), frame)


def honest(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def drawn(core: CoordinatorCore, reporter: str, target: str, *, step: int = 0, ticket: int = 1) -> list[str]:
    """The witnesses the coordinator draws for ``reporter``'s check of ``target`` (what a node asks first)."""
    return core.handle(reporter, cm.WitnessDraw(target=target, step=step, ticket=ticket, direction="fwd"), 0.9).witnesses


def report(core: CoordinatorCore, reporter: str, target: str, ev: OutputEvidence | None, now: float = 1.0) -> cm.ReportReply:
    return core.handle(reporter, cm.IntegrityReport(target=target, reason="spot check", evidence=ev), now)


def refused(core: CoordinatorCore, reporter: str, target: str, ev: OutputEvidence | None) -> str:
    with pytest.raises(Refusal) as err:
        report(core, reporter, target, ev)
    return err.value.reason


def test_two_agreeing_recomputations_convict_the_odd_replica_and_the_ban_persists(tmp_path) -> None:
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core)
    liar, b, d = sw.stage[0]
    checker = sw.stage[1][0]
    assert sorted(drawn(core, checker, liar)) == sorted([b, d])  # two eligible replicas: both are drawn
    y = honest()
    ev = OutputEvidence(accused=liar, step=0, ticket=1, direction="fwd", stage=0, inputs=b"",
                  outputs=[sw.output(liar, -y), sw.output(b, y), sw.output(d, y)])
    reply = report(core, checker, liar, ev)
    assert reply.banned and "spot check" in reply.reason and "2 other replicas" in reply.reason
    assert core.verdicts.is_banned(liar) and not core.verdicts.is_banned(b)
    st = core.handle("x", cm.StatusRequest(), 2.0)
    assert [(v.peer_id, "integrity" in v.reason) for v in st.bans] == [(liar, True)]
    # The ban and the evidence record survive a coordinator restart (the store is SQLite).
    store = Store(tmp_path)
    store.apply(core.drain())
    loaded = store.load()
    store.close()
    again = make_core(RUN, SETTINGS)
    again.restore(**loaded, now=5.0)
    assert again.verdicts.is_banned(liar) and again.integrity.against[liar] == 1 and again.integrity.filed[checker] == 1


def test_a_signed_nan_convicts_its_signer_alone() -> None:
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core)
    liar = sw.stage[0][0]
    bad = honest()
    bad[0, 0, 0] = float("nan")
    ev = OutputEvidence(accused=liar, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(liar, bad)])
    reply = report(core, sw.stage[1][0], liar, ev)
    assert reply.banned and "NaN" in reply.reason


def test_no_single_peer_can_frame_an_honest_replica() -> None:
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core, n0=3)
    a, b, d = sw.stage[0]
    checker = sw.stage[1][0]
    drawn(core, checker, a)
    y = honest()
    # The checker alters the accused's output: the accused's signature no longer holds.
    forged = sw.output(a, y).model_copy(update={"data": (-y).numpy().tobytes()})
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[forged, sw.output(b, y), sw.output(d, y)])
    assert "signature" in refused(core, checker, a, ev)
    # One lying recomputation against two honest outputs: the two others disagree, no majority.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, y), sw.output(b, -y), sw.output(d, y)])
    assert "no majority" in refused(core, checker, a, ev)
    # Outputs of different inputs: the statements do not match (the accused signed other inputs).
    other = sw.output(b, y, inputs=b"\x01" * 32)
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y), other, sw.output(d, y)])
    assert "signature" in refused(core, checker, a, ev)
    # A recomputation by a peer that is not a replica of the stage counts for nothing.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y), sw.output(b, y), sw.output(checker, y)])
    assert "not the ones the coordinator drew" in refused(core, checker, a, ev)
    # Evidence of a check nobody drew witnesses for (here: another ticket) is refused.
    ev = OutputEvidence(accused=a, step=0, ticket=2, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y, ticket=2), sw.output(b, y, ticket=2), sw.output(d, y, ticket=2)])
    assert "no witness draw on record" in refused(core, checker, a, ev)
    # Only a neighbouring stage receives a stage's outputs, so only it reports them.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y), sw.output(b, y), sw.output(d, y)])
    assert "next to" in refused(core, b, a, ev)
    with pytest.raises(Refusal, match="next to"):
        drawn(core, b, a)
    assert not any(core.verdicts.is_banned(p) for p in sw.ids)


def test_codec_error_is_not_a_fault_but_a_scaled_output_is() -> None:
    core = make_core(RUN, SETTINGS)
    core.run = RunInfo(**{**core.run.__dict__, "codec": "int8"})
    core.integrity.run = core.run
    sw = Swarm(core)
    a, b, d = sw.stage[0]
    checker = sw.stage[1][0]
    drawn(core, checker, a)
    y = honest(3)
    # An honest int8 frame against raw recomputations: within the codec's tolerance, refused as no fault.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, y, codec="int8"), sw.output(b, y), sw.output(d, y)])
    assert "no fault" in refused(core, checker, a, ev)
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, 10 * y, codec="int8"), sw.output(b, y), sw.output(d, y)])
    assert report(core, checker, a, ev).banned


def test_subspace_frames_in_evidence_are_decoded_with_the_runs_subspace() -> None:
    # The coordinator rebuilds the basis and fixed embedding from the run's seed (protolearn/subspace.py)
    # to decode the accused's subspace frame, then judges it like any other codec's.
    from protolearn.subspace import make_subspace

    core = make_core(RUN, SETTINGS)
    core.run = RunInfo(**{**core.run.__dict__, "codec": "subspace:fp16", "subspace": (5, 259, SHAPE[2], 3, 0.02)})
    core.integrity.run = core.run
    sub = make_subspace(5, 259, SHAPE[2], 3, 0.02)
    tokens = torch.randint(0, 259, SHAPE[:2], generator=torch.Generator().manual_seed(2))
    y = sub.fixed_embedding[tokens] + honest(4)[..., :3] @ sub.basis.T  # an activation of a constrained model
    ctx = CodecContext(sub, "fwd", tokens)
    sw = Swarm(core)
    a, b, d = sw.stage[0]
    checker = sw.stage[1][0]
    drawn(core, checker, a)
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, y, codec="subspace", context=ctx), sw.output(b, y), sw.output(d, y)])
    assert "no fault" in refused(core, checker, a, ev)
    lie = sub.fixed_embedding[tokens] + 3 * (y - sub.fixed_embedding[tokens])  # still in the subspace, three times too far out
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, lie, codec="subspace", context=ctx), sw.output(b, y), sw.output(d, y)])
    assert report(core, checker, a, ev).banned


def test_a_report_without_evidence_flags_and_never_bans() -> None:
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core)
    target = sw.stage[0][0]
    for k in range(20):
        reply = report(core, sw.stage[1][0], target, None, now=1.0 + k)
        assert not reply.banned
    assert not core.verdicts.is_banned(target)
    st = core.handle("x", cm.StatusRequest(), 30.0)
    node = next(n for n in st.nodes if n.peer_id == target)
    assert "integrity:20" in node.flags and node.evidence == 20


def test_status_shows_what_checkers_report_as_the_median() -> None:
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core, n0=3)
    target = sw.stage[0][0]
    checker = sw.stage[1][0]
    other = sw.stage[0][1]  # a same-stage peer's claim is shown too, but one claim is one vote
    core.handle(checker, cm.Heartbeat(state="training", checks=[cm.PeerCheck(peer_id=target, score=0.2, state="trusted", passed=12, failed=0)]), 1.0)
    core.handle(other, cm.Heartbeat(state="training", checks=[cm.PeerCheck(peer_id=target, score=50.0, state="failed", passed=0, failed=3)]), 1.0)
    st = core.handle("x", cm.StatusRequest(), 2.0)
    node = next(n for n in st.nodes if n.peer_id == target)
    assert node.integrity == 0.2 and node.probation == "probation" and (node.checks_passed, node.checks_failed) == (12, 3)
    assert st.schema_version >= 2  # the integrity fields came with schema 2
    # A reporter's next heartbeat replaces its claims.
    core.handle(other, cm.Heartbeat(state="training"), 3.0)
    node = next(n for n in core.handle("x", cm.StatusRequest(), 3.5).nodes if n.peer_id == target)
    assert node.probation == "trusted" and node.checks_failed == 0


def test_recomputations_count_only_from_live_replicas_the_coordinator_assigned_to_the_stage() -> None:
    # Issue 27: two stage-1 Sybils claimed stage 0 in their heartbeats ("serving"), signed the same made-up
    # output for an honest stage-0 node's signed inputs, and one filed the report: the honest node was banned.
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core, n0=3)
    while len(sw.stage[1]) < 3:
        ident = Identity.generate()
        reply = core.handle(ident.peer_id, cm.Join(addrs=["/ip4/127.0.0.1/tcp/9"], throughput=100.0), 0.0)
        sw.ids[ident.peer_id] = ident
        sw.stage[reply.stage].append(ident.peer_id)
    a = sw.stage[0][0]
    s1, s2 = sw.stage[1][:2]
    y = honest()
    for s in (s1, s2):
        core.handle(s, cm.Heartbeat(state="training", stage=0), 0.5)  # a claim of serving stage 0
    # The draw comes from the coordinator's records: the Sybils' claim does not make them witnesses ...
    witnesses = drawn(core, s1, a)
    assert witnesses and not {s1, s2} & set(witnesses) and all(core.registry.assigned(w, 0) for w in witnesses)
    # ... and evidence signed by them instead of the drawn witnesses is refused.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, y), sw.output(s1, -y), sw.output(s2, -y)])
    assert "not the ones the coordinator drew" in refused(core, s1, a, ev)
    # A drawn replica of stage 0 that has left signs nothing that counts either.
    reporter = sw.stage[1][2]
    witnesses = drawn(core, reporter, a)
    core.handle(witnesses[0], cm.Leave(), 0.6)
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, y)] + [sw.output(w, -y) for w in witnesses])
    assert "no longer a live replica of stage 0" in refused(core, reporter, a, ev)
    assert not any(core.verdicts.is_banned(p) for p in sw.ids)


def test_the_draw_is_the_coordinators_fixed_choice_and_a_majority_of_the_stage() -> None:
    """Issue 27, rule 4: the accuser never picks the witnesses. The draw is a strict majority of the eligible
    replicas (2 to 8), the same each time the same check is asked, and evidence must hold all of it."""
    core = make_core(RUN, SETTINGS)
    sw = Swarm(core, n0=6)
    a = sw.stage[0][0]
    checker = sw.stage[1][0]
    first = drawn(core, checker, a)
    assert len(first) == 3 and a not in first and checker not in first  # 5 eligible: a strict majority is 3
    assert drawn(core, checker, a) == first  # asking again does not re-roll
    others = {tuple(drawn(core, checker, a, ticket=t)) for t in range(2, 40)}
    assert len({frozenset(o) for o in others}) > 1  # other checks draw other witnesses (10 subsets of 3 among 5)
    y = honest()
    # Evidence with only some of the drawn witnesses (the one left out might side with the accused): refused.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y)] + [sw.output(w, y) for w in first[:2]])
    assert "not the ones the coordinator drew" in refused(core, checker, a, ev)
    # All of them agreeing against the accused: convicted, with the count in the reason.
    ev = OutputEvidence(accused=a, step=0, ticket=1, direction="fwd", stage=0, inputs=b"", outputs=[sw.output(a, -y)] + [sw.output(w, y) for w in first])
    reply = report(core, checker, a, ev)
    assert reply.banned and "3 other replicas" in reply.reason
    # A banned replica is never drawn.
    assert a not in drawn(core, checker, first[0])
