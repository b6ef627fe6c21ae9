"""PowerSGD as replicas run it: two summed rounds, one deterministic decoding, error feedback and a warm start.

The rounds are summed here directly (the collective's exact float32 sum is tested on its own); what is
checked is what every replica computes around them: which tensors are factored, that the update is the
projection of the true sum onto one common basis whatever warm start each replica holds, that decoding is
the same bits whatever torch's thread count, that a low-rank gradient is recovered, that the running sum
of what a replica's contribution decodes to tracks its running gradient, and that a redone attempt or a
reset starts from the committed state.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from protolearn.protocol.sync_compression.powersgd import Layout, PowerSGD, decode, orthonormalize, reconstruct

SHAPES = [(48, 40), (40,), (8, 3), (12, 5, 6), (259, 64)]


def step_all(reps: list[PowerSGD], grads: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    for r in reps:
        r.begin(step)
    p_sum = torch.stack([r.first(g) for r, g in zip(reps, grads)]).sum(0)
    q_sum = torch.stack([r.second(step, p_sum) for r in reps]).sum(0)
    return [r.finish(step, p_sum, q_sum) for r in reps]


def test_the_layout_factors_only_matrices_it_makes_smaller() -> None:
    lay = Layout.of(SHAPES, 4)
    assert [b.compressed for b in lay.blocks] == [True, False, False, True, True]
    assert (lay.blocks[3].rows, lay.blocks[3].cols) == (12, 30)
    assert lay.p_numel == 48 * 4 + 40 + 24 + 12 * 4 + 259 * 4
    assert lay.q_numel == 40 * 4 + 30 * 4 + 64 * 4
    assert lay.numel == sum(torch.Size(s).numel() for s in SHAPES)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), r=st.integers(1, 6), seed=st.integers(0, 1000))
def test_orthonormalize_gives_orthonormal_columns_the_same_bits_at_any_thread_count(n: int, r: int, seed: int) -> None:
    p = torch.randn(n, r, generator=torch.Generator().manual_seed(seed))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = orthonormalize(p)
        torch.set_num_threads(max(2, threads))
        two = orthonormalize(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    gram = one.double().T @ one.double()
    kept = gram.diagonal() > 0.5  # columns beyond the rank are zero
    assert int(kept.sum()) == min(n, r)
    torch.testing.assert_close(gram[kept][:, kept], torch.eye(int(kept.sum()), dtype=torch.float64), atol=1e-5, rtol=0)


def test_every_replica_applies_the_same_projection_of_the_true_sum_whatever_its_warm_start() -> None:
    reps = [PowerSGD(SHAPES, 4, seed=0) for _ in range(3)]
    reps[2].q = [None if q is None else torch.randn_like(q) for q in reps[2].q]  # a replica that just resynced elsewhere
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(reps[0].layout.numel, generator=gen) for _ in reps]
    for r in reps:
        r.begin(0)
    p_sum = torch.stack([r.first(g) for r, g in zip(reps, grads)]).sum(0)
    q_sum = torch.stack([r.second(0, p_sum) for r in reps]).sum(0)
    ups = [r.finish(0, p_sum, q_sum) for r in reps]
    assert all(torch.equal(u, ups[0]) for u in ups), "I2: the update is a function of the two results"
    assert torch.equal(decode(reps[0].layout, p_sum, q_sum), ups[0]), "a replica that fetched both results decodes the same"
    total = torch.stack(grads).sum(0)
    lay = reps[0].layout
    for b in lay.blocks:
        got = ups[0][b.offset : b.offset + b.numel]
        want = total[b.offset : b.offset + b.numel]
        if not b.compressed:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # raw tensors: the exact sum
            continue
        u = orthonormalize(p_sum[b.p_offset : b.p_offset + b.rows * 4].reshape(b.rows, 4)).double()
        proj = (u @ (u.T @ want.reshape(b.rows, b.cols).double())).reshape(-1)
        torch.testing.assert_close(got.double(), proj, rtol=1e-4, atol=1e-4)


def test_a_low_rank_gradient_is_recovered_once_the_warm_start_has_found_it() -> None:
    shapes = [(64, 48)]
    reps = [PowerSGD(shapes, 2, seed=3) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 2, generator=gen), torch.randn(48, 2, generator=gen)
    errors = []
    for t in range(6):
        grads = [(a @ b.T * (1 + k)).reshape(-1) for k in range(2)]
        ups = step_all(reps, grads, t)
        for r in reps:
            r.commit(t)
        total = grads[0] + grads[1]
        errors.append(float((ups[0] - total).norm() / total.norm()))
    assert errors[-1] < 1e-4, errors


@settings(max_examples=15, deadline=None)
@given(steps=st.integers(1, 8), seed=st.integers(0, 1000))
def test_the_running_sum_of_a_replicas_decoded_contribution_tracks_its_gradients(steps: int, seed: int) -> None:
    # A replica's decoded contribution is U Q_i^T (its own share of the update); plus its residual, it
    # adds up to exactly the gradients it summed (up to float rounding).
    shapes = [(20, 16), (16,)]
    reps = [PowerSGD(shapes, 2, seed=0) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    lay = reps[0].layout
    b = lay.blocks[0]
    total_in = torch.zeros(lay.numel, dtype=torch.float64)
    total_own = torch.zeros(lay.numel, dtype=torch.float64)
    for t in range(steps):
        grads = [torch.randn(lay.numel, generator=gen) for _ in reps]
        for r in reps:
            r.begin(t)
        p_sum = torch.stack([r.first(g) for r, g in zip(reps, grads)]).sum(0)
        q_own = [r.second(t, p_sum) for r in reps]
        q_sum = torch.stack(q_own).sum(0)
        for r in reps:
            r.finish(t, p_sum, q_sum)
            r.commit(t)
        u = orthonormalize(p_sum[: b.rows * 2].reshape(b.rows, 2))
        own = torch.zeros(lay.numel)
        own[: b.numel] = reconstruct(u, q_own[0][: b.cols * 2].reshape(b.cols, 2)).reshape(-1)
        own[b.numel :] = grads[0][b.numel :]  # raw: sent exactly
        total_in += grads[0].double()
        total_own += own.double()
    residual = reps[0].feedback.residual
    assert residual is not None
    torch.testing.assert_close(total_own + residual.double(), total_in, rtol=0, atol=1e-4 * steps)


def test_a_failed_attempt_commits_nothing_and_a_reset_restarts_from_the_seed() -> None:
    rep = PowerSGD(SHAPES, 4, seed=7)
    q0 = [None if q is None else q.clone() for q in rep.q]
    g = torch.randn(rep.layout.numel, generator=torch.Generator().manual_seed(0))
    rep.begin(0)
    p = rep.first(g)
    rep.second(0, p)  # round B then fails: nothing is committed, the step is averaged again
    rep.begin(0)
    p2 = rep.first(g)
    assert torch.equal(p, p2), "the redo starts from the same residual and warm start"
    q = rep.second(0, p2)
    rep.finish(0, p2, q)
    rep.commit(0)
    assert rep.feedback.residual is not None and not torch.equal(rep.q[0], q0[0])
    rep.reset()
    assert rep.feedback.residual is None and all(a is None and b is None or torch.equal(a, b) for a, b in zip(rep.q, q0))
