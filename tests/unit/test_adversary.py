"""The adversaries: each lie does what its name says, is deterministic, and leaves its input alone; and the
attack reaches the swarm only through the node's outbound filter and (for ``stale``) its worker."""

from __future__ import annotations

import pytest
import torch

from protolearn.errors import ConfigError
from protolearn.node.adversary import KINDS, NAN_FRACTION, SCALE_FACTOR, TENSOR_KINDS, Adversary, Attack, StaleWorker, parse_adversary
from protolearn.node.outbound import PASS_THROUGH
from protolearn.node.worker import StageWorker
from protolearn.stages.config import RunConfig

SEED = 1234


def honest(seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, 32, generator=g) * 0.7 + 0.1  # (B, T, D)


def rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


def lie(kind: str, t: torch.Tensor, **kw: object) -> torch.Tensor:
    args = {"step": 3, "ticket": 1, "direction": "fwd"} | kw
    return Adversary(kind, seed=7).corrupt(t, **args)  # type: ignore[arg-type]


def test_scale_signflip_zero() -> None:
    t = honest()
    assert torch.equal(lie("scale", t), t * SCALE_FACTOR)
    assert torch.equal(lie("signflip", t), -t)
    z = lie("zero", t)
    assert z.shape == t.shape and not z.any()


def test_noise_adds_gaussian_of_the_tensors_rms() -> None:
    t = honest()
    d = lie("noise", t) - t
    assert abs(rms(d) / rms(t) - 1.0) < 0.05
    assert abs(float(torch.nn.functional.cosine_similarity(d.flatten(), t.flatten(), dim=0))) < 0.05


def test_random_keeps_the_norm_and_loses_the_direction() -> None:
    t = honest()
    r = lie("random", t)
    assert abs(rms(r) / rms(t) - 1.0) < 0.05
    assert abs(float(torch.nn.functional.cosine_similarity(r.flatten(), t.flatten(), dim=0))) < 0.05


def test_nan_poisons_a_fraction_and_keeps_the_rest() -> None:
    t = honest()
    n = lie("nan", t)
    bad = torch.isnan(n)
    assert int(bad.sum()) == round(NAN_FRACTION * t.numel())
    assert torch.equal(n[~bad], t[~bad])
    one = torch.ones(3)
    assert int(torch.isnan(lie("nan", one)).sum()) == 1  # at least one, even when 1% rounds to 0


@pytest.mark.parametrize("kind", ["noise", "random", "nan"])
def test_deterministic_per_seed_step_ticket_direction(kind: str) -> None:
    t = honest()
    a, b = lie(kind, t), lie(kind, t)
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    for other in ({"step": 4}, {"ticket": 2}, {"direction": "bwd"}):
        c = lie(kind, t, **other)
        assert not (torch.equal(a.nan_to_num(), c.nan_to_num()) and torch.equal(a.isnan(), c.isnan())), other
    c = Adversary(kind, seed=8).corrupt(t, step=3, ticket=1, direction="fwd")
    assert not torch.equal(a.nan_to_num(), c.nan_to_num())


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_input_untouched_and_global_rng_unused(kind: str) -> None:
    t = honest()
    before = t.clone()
    torch.manual_seed(99)
    expected = torch.rand(1)
    torch.manual_seed(99)
    out = lie(kind, t)
    assert torch.equal(t, before)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in TENSOR_KINDS])
def test_other_kinds_leave_tensors_alone(kind: str) -> None:
    t = honest()
    assert lie(kind, t) is t


def test_unknown_direction_is_refused() -> None:
    with pytest.raises(ValueError, match="direction"):
        lie("noise", honest(), direction="sideways")


def test_parse_still_needs_the_env_and_keeps_from_step() -> None:
    adv = parse_adversary("random:5", env={"PROTOLEARN_ALLOW_ADVERSARY": "1"})
    assert adv == Adversary("random", 5) and not adv.active(4) and adv.active(5) and adv.corrupts_tensors
    with pytest.raises(ConfigError):
        parse_adversary("random:5", env={})


# -- the attack as one outbound filter (node/outbound.py), built from outside the production classes ----------
class _Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []

    def event(self, event: str, **fields: object) -> None:
        self.got.append((event, fields))


TINY = RunConfig.model_validate({
    "name": "liar", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "batch": {"microbatches_per_step": 2, "microbatch_size": 2, "seq_len": 16}, "data": {"max_bytes": 100_000},
})


def test_an_honest_node_sends_everything_as_computed_and_withholds_nothing() -> None:
    t = honest()
    assert PASS_THROUGH.tensor(t, 5, 1, "fwd") is t and PASS_THROUGH.tensor(t, 5, 1, "bwd", check=True) is t
    assert PASS_THROUGH.part_filter is None and not PASS_THROUGH.withholds(5)


def test_a_tensor_liar_lies_from_its_step_on_in_what_it_sends_and_serves_and_counts_each_lie() -> None:
    events = _Events()
    attack = Attack(Adversary("signflip", from_step=2), events)  # type: ignore[arg-type]
    f = attack.outbound(StageWorker(TINY, 0))
    t = honest()
    assert f.tensor(t, 1, 0, "fwd") is t and not events.got  # not yet
    assert torch.equal(f.tensor(t, 2, 3, "fwd"), -t)
    assert torch.equal(f.tensor(t, 2, 3, "bwd", check=True), -t)  # a spot-check result it serves, too
    assert events.got == [
        ("adversary", {"kind": "signflip", "step": 2, "ticket": 3, "direction": "fwd", "sent": 1}),
        ("adversary", {"kind": "signflip", "step": 2, "ticket": 3, "direction": "bwd", "sent": 2}),
    ]
    # The count runs on across the stages the node builds.
    assert torch.equal(attack.outbound(StageWorker(TINY, 1)).tensor(t, 4, 0, "bwd"), -t) and attack.sent == 3
    assert f.part_filter is None and not f.withholds(9)


def test_a_reducer_liar_corrupts_the_parts_it_reduces_and_a_blackhole_withholds_from_its_step() -> None:
    events = _Events()
    reducer = Attack(Adversary("reducer"), events).outbound(StageWorker(TINY, 1))  # type: ignore[arg-type]
    t = honest()
    assert reducer.tensor(t, 0, 0, "fwd") is t and reducer.part_filter is not None
    assert torch.equal(reducer.part_filter(3, t), t + 1.0)
    assert events.got == [("adversary", {"kind": "reducer", "part": 3, "sent": 1})]
    hole = Attack(Adversary("blackhole", from_step=4), events).outbound(StageWorker(TINY, 0))  # type: ignore[arg-type]
    assert not hole.withholds(3) and hole.withholds(4) and hole.tensor(t, 4, 0, "fwd") is t


def test_a_stale_liar_sends_outputs_of_its_old_weights_once_it_applied_from_step_and_counts_them() -> None:
    events = _Events()
    attack = Attack(Adversary("stale", from_step=1), events)  # type: ignore[arg-type]
    worker = attack.worker(TINY, 1, "cpu", bf16_autocast=False)
    assert isinstance(worker, StaleWorker) and not worker.serving_old_weights
    f = attack.outbound(worker)
    hidden = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))  # (mb, T, D)
    targets = torch.randint(0, TINY.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    assert f.tensor(hidden, 0, 0, "bwd") is hidden and not events.got  # honest so far
    _, before = worker.forward_backward_last((0, 0), hidden, targets)
    ones = torch.ones(worker.numel)
    worker.apply(0, ones)  # it has applied 1 step: from here on its weights for what it sends are frozen
    assert worker.serving_old_weights
    _, frozen = worker.forward_backward_last((1, 0), hidden, targets)
    worker.apply(1, ones)
    _, later = worker.forward_backward_last((2, 0), hidden, targets)
    honest_now = worker.recompute(2, "bwd", [hidden], targets)  # what a spot check of it recomputes
    assert torch.equal(frozen, later) and not torch.equal(later, before) and not torch.allclose(later, honest_now)
    assert f.tensor(later, 2, 0, "bwd") is later and f.tensor(honest_now, 2, 0, "bwd", check=True) is honest_now
    assert events.got == [("adversary", {"kind": "stale", "step": 2, "ticket": 0, "direction": "bwd", "sent": 1})]
