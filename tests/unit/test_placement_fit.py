"""Joins the run does not fit: a precision it does not admit, and memory that holds no stage or only some.

Against the real coordinator core (``coordinator/core/dispatch.py``) with the demo run's footprints
(``stages/footprint.py``): a node offering less than the smallest stage is refused with one line naming
both amounts, one that holds only one stage is placed there even where placement by throughput would
pick the other, and a node saying nothing is placed as before. Memory claims are bounded on the wire.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.fit import fitting
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.stages.config import RunConfig, default_run
from protolearn.stages.footprint import GB, stage_footprints

ADDRS = ["/ip4/10.0.0.1/tcp/1"]


def core(run: RunConfig) -> CoordinatorCore:
    return CoordinatorCore(RunInfo.from_run(run), CoordinatorSettings(rate_per_s=1e6, rate_burst=1e6), peer_id="coord", started_at=0.0)


def join(c: CoordinatorCore, peer: str, **kw) -> cm.JoinReply:
    return c.handle(peer, cm.Join(addrs=ADDRS, name=peer, **kw), 0.0)  # type: ignore[return-value]


def admitting(*precisions: str) -> RunConfig:
    run = default_run()
    return run.model_copy(update={"integrity": run.integrity.model_copy(update={"precisions": precisions})})


def test_a_precision_the_run_does_not_admit_is_refused_with_what_to_do() -> None:
    with pytest.raises(Refusal) as err:
        join(core(admitting("fp32")), "a", precision="bf16")
    assert err.value.code == "precision" and "admits only fp32" in err.value.reason and "without --bf16" in err.value.reason
    c = core(admitting("fp32", "bf16"))
    assert join(c, "a", precision="bf16").stage in (0, 1) and c.registry.is_live("a")


def test_memory_below_the_smallest_stage_is_refused_in_one_line_naming_both_amounts() -> None:
    run = default_run()
    need = min(f.total(8) for f in stage_footprints(run)) / GB
    c = core(run)
    with pytest.raises(Refusal) as err:
        join(c, "small", memory_gb=need * 0.9, max_in_flight=8)
    why = err.value.reason
    assert err.value.code == "no_fit" and "\n" not in why, why
    assert f"offers {need * 0.9:.3g} GB" in why and f"needs {need:.3g} GB" in why, why
    assert not c.registry.members


def test_a_node_that_holds_one_stage_only_is_placed_there() -> None:
    run = default_run()
    f0, f1 = (f.total(8) / GB for f in stage_footprints(run))
    assert f1 < f0  # the demo's last stage holds no activation graphs between forward and backward
    placed = []
    for memory_gb in (0.0, (f0 + f1) / 2):  # the third joiner: unconstrained, then holding stage 1 only
        c = core(run)
        assert [join(c, "a").stage, join(c, "b").stage] == [0, 1]  # empty stages first
        placed.append(join(c, "c", memory_gb=memory_gb, max_in_flight=8))
    assert placed[0].stage == 0, placed[0].reason  # by throughput the tie goes to stage 0 ...
    assert placed[1].stage == 1, placed[1].reason  # ... but stage 0 does not fit
    assert fitting(stage_footprints(run), (f0 + f1) / 2, 8) == [False, True]
    assert fitting(stage_footprints(run), 0.0, 8) == [True, True]  # not said: fits everywhere


def test_memory_claims_are_bounded_on_the_wire() -> None:
    for bad in (-1.0, 1e7, float("inf"), float("nan")):
        with pytest.raises(ValidationError):
            cm.Join(addrs=ADDRS, memory_gb=bad)
    with pytest.raises(ValidationError):
        cm.Join(addrs=ADDRS, max_in_flight=10**6)
    with pytest.raises(ValidationError):
        cm.Join(addrs=ADDRS, precision="fp8")
