"""DiLoCo's outer optimizer (stages/outer.py) and a stage replica's outer state (node/worker.py, DiLoCo mode).

The outer step is SGD with Nesterov momentum on the averaged pseudo-gradient (what torch's SGD computes,
checked step by step); replicas that trained apart and average their pseudo-gradients end bit-identical,
and their state after the sync travels (to a joiner, into a checkpoint) with its momentum.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protolearn.node.checkpoint import OUTER_KEY, load_checkpoint, save_checkpoint
from protolearn.node.worker import StageWorker
from protolearn.stages.outer import flatten, nesterov_step, pseudo_gradient, unflatten_into
from protolearn.stages.stage import state_root
from tests.support.runs import tiny_run

H = 3


def test_nesterov_step_is_torch_sgd_with_nesterov_momentum_on_the_pseudo_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    anchor = torch.randn(50, generator=g)
    momentum = torch.zeros(50)
    ref = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        avg = torch.randn(50, generator=g)
        anchor, momentum = nesterov_step(anchor, momentum, avg, lr=0.7, mu=0.9)
        ref.grad = avg.clone()
        sgd.step()
        assert torch.allclose(anchor, ref.detach(), atol=1e-6, rtol=0)


def test_outer_vectors_must_match_and_flat_round_trips() -> None:
    with pytest.raises(ValueError, match="mismatched"):
        nesterov_step(torch.zeros(3), torch.zeros(3), torch.zeros(4), lr=1.0, mu=0.5)
    params = [torch.zeros(2, 3), torch.zeros(4)]
    unflatten_into(torch.arange(10.0), params)
    assert torch.equal(flatten(params), torch.arange(10.0))
    assert torch.equal(pseudo_gradient(torch.full((10,), 10.0), params), 10.0 - torch.arange(10.0))
    with pytest.raises(ValueError):
        unflatten_into(torch.arange(11.0), params)


def _diloco_run(**sync):
    return tiny_run((1, 1), sync={"mode": "diloco", "inner_steps": H, **sync})


def _train_inner(w: StageWorker, step: int, tickets: list[int], seed: int) -> None:
    """One inner step of stage 0 (its own loss on its output: enough to give it real gradients)."""
    run = w.run
    for t in tickets:
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + t)
        tokens = torch.randint(0, run.model.vocab_size, (run.batch.microbatch_size, run.batch.seq_len), generator=g)
        out = w.forward((step, t), tokens)
        w.backward((step, t), torch.randn(out.shape, generator=g) * 1e-2)
    w.apply_inner(step, tickets)


def test_replicas_that_trained_apart_are_identical_after_the_outer_step() -> None:
    run = _diloco_run()
    a, b = StageWorker(run, 0), StageWorker(run, 0)
    assert a.outer is not None and a.outer.anchor_hash == b.outer.anchor_hash == a.step_hash()  # no momentum yet: the parameters alone
    for step in range(H):
        _train_inner(a, step, [0], seed=1)
        _train_inner(b, step, [1], seed=2)
    assert a.step_hash() != b.step_hash()  # between syncs replicas differ
    # What the collective computes: the weighted sum of w * delta over the replicas, then / total weight.
    wa, wb = 3.0, 1.0
    avg = (a.pseudo_gradient() * wa + b.pseudo_gradient() * wb) / (wa + wb)
    ha, hb = a.apply_outer(avg, H), b.apply_outer(avg.clone(), H)
    assert ha == hb == a.state_hash() == b.state_hash() and a.step_hash() == b.step_hash()
    assert a.outer.anchor_applied == H and torch.equal(a.outer.momentum, b.outer.momentum)
    assert a.outer.momentum.abs().sum() > 0
    assert ha != a.step_hash()  # the shared state's hash covers the outer momentum, not only the parameters


def test_an_inner_step_with_no_ticket_changes_nothing() -> None:
    w = StageWorker(_diloco_run(), 0)
    before = w.step_hash()
    assert w.apply_inner(0, [])[0] == before and w.applied == 1


def test_a_joiner_takes_the_anchor_and_its_momentum_not_the_donors_inner_state() -> None:
    run = _diloco_run()
    donor = StageWorker(run, 0)
    for step in range(H):
        _train_inner(donor, step, [0, 1], seed=1)
    donor.apply_outer(donor.pseudo_gradient(), H)
    anchor_hash = donor.outer.anchor_hash
    _train_inner(donor, H, [0], seed=1)  # the donor trains on: its parameters move away from the anchor
    assert donor.step_hash() != anchor_hash
    snapshot = dict(donor.snapshot())
    assert donor.step_hash() != anchor_hash  # taking the snapshot put its own parameters back
    # What it serves: the anchor's hash, from the digests of the anchor and the momentum only (not its inner state).
    served = donor.shared_snapshot(lambda: H + 1, False)
    assert served.applied == H and served.state_hash == state_root(served.leaves) == anchor_hash
    assert {n.split("/", 1)[0] for n, _ in served.leaves} == {"param", OUTER_KEY}
    joiner = StageWorker(run, 0)
    assert all(joiner.expected(n) is not None for n in snapshot)
    assert joiner.load(snapshot) == anchor_hash
    joiner.anchored(H, since_step=H + 1)
    assert torch.equal(joiner.outer.momentum, donor.outer.momentum) and torch.equal(joiner.outer.anchor, donor.outer.anchor)
    # The anchor's hash covers the outer momentum: a donor that sends another momentum with the stage's anchor
    # hands over a state that does not hash to the stage's, and the joiner's check refuses it (node/syncing.py).
    lied = {n: (t * 2 if n.startswith(f"{OUTER_KEY}/") else t) for n, t in snapshot.items()}
    assert StageWorker(run, 0).load(lied) != anchor_hash
    # A spot check may recompute only at the weights after an outer sync, on the first step after it.
    joiner.applied = H + 1
    with pytest.raises(ValueError, match="first inner step"):
        joiner.recompute(H + 1, "fwd", [torch.zeros(run.batch.microbatch_size, run.batch.seq_len, dtype=torch.long)], None)


def test_a_checkpoint_holds_the_anchor_and_the_momentum(tmp_path: Path) -> None:
    run = _diloco_run()
    w = StageWorker(run, 0)
    for step in range(H):
        _train_inner(w, step, [0, 1], seed=3)
    w.apply_outer(w.pseudo_gradient(), H)
    anchor_hash = w.outer.anchor_hash
    _train_inner(w, H, [0], seed=3)
    path = w.with_anchor(lambda: save_checkpoint(tmp_path, run, 0, H, w.module, w.optimizer, outer_momentum=w.outer_momentum()))
    back = StageWorker(run, 0)
    outer: dict = {}
    assert load_checkpoint(path, run, 0, back.module, back.optimizer, outer=outer) == H
    back.take_anchor(outer)
    assert back.state_hash() == anchor_hash == back.outer.anchor_hash
    assert torch.equal(back.outer.momentum, w.outer.momentum)
