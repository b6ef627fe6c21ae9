"""Chained stage modules compute exactly what the whole Transformer computes, for any split."""

from __future__ import annotations


import pytest
import torch

from protolearn.stages.errors import MicrobatchStateError, StageInputError
from protolearn.stages.model import Transformer
from protolearn.stages.stage import build_stage
from tests.support.runs import tiny_run


pytestmark = pytest.mark.usefixtures("one_torch_thread")


SPLITS = [[4], [2, 2], [1, 3], [3, 1], [1, 1, 2], [2, 1, 1], [1, 1, 1, 1]]


def tokens(seed: int, shape: tuple[int, int] = (3, 16)) -> torch.Tensor:
    return torch.randint(0, 259, shape, generator=torch.Generator().manual_seed(seed))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("layers", SPLITS, ids=str)
def test_chained_stages_match_whole_model(layers: list[int]) -> None:
    run = tiny_run(layers, seed=7)
    whole = Transformer(run.model, run.seed)
    stages = [build_stage(run, s) for s in range(len(layers))]
    x, y = tokens(1), tokens(2)
    scale = 0.25

    ref_loss = whole.loss(x, y)
    (ref_loss * scale).backward()
    ref_loss = ref_loss.detach()
    ref_hidden = [whole.embed(x)]
    with torch.no_grad():
        for block in whole.blocks.values():
            ref_hidden.append(block(ref_hidden[-1]))

    # Logits: feed the last stage the same input the pipeline gives it.
    with torch.no_grad():
        last_in = x if len(stages) == 1 else ref_hidden[stages[-1].layers.start]
        assert rel_diff(stages[-1].logits(last_in), whole(x)) <= 1e-6

    h = x
    for st in stages:
        h = st(0, h, y if st.last else None)
        if not st.last:
            # The boundary activation equals the whole model's hidden after the same global layer.
            assert rel_diff(h, ref_hidden[st.layers.stop]) <= 1e-6
    assert abs(float(h) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))

    grad = None
    for st in reversed(stages):
        grad = st.backward(0, grad, loss_scale=scale if st.last else 1.0)
    assert grad is None  # stage 0 has no input gradient

    ref_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = set()
    for st in stages:
        for n, p in st.named_parameters():
            assert rel_diff(p.grad, ref_grads[n]) <= 1e-6, n
            seen.add(n)
        assert st.in_flight() == 0
    assert seen == set(ref_grads)  # the stages hold every parameter exactly once


@pytest.mark.parametrize("layers", SPLITS, ids=str)
def test_stage_built_alone_equals_stage_cut_from_whole_model(layers: list[int]) -> None:
    run = tiny_run(layers, seed=7)
    whole = dict(Transformer(run.model, run.seed).named_parameters())
    for s in range(len(layers)):
        st = build_stage(run, s)
        for n, p in st.named_parameters():
            assert torch.equal(p, whole[n]), n
        assert st.state_hash() == build_stage(run, s).state_hash()


def test_init_depends_on_seed_and_parameter_only() -> None:
    a, b = build_stage(tiny_run([2, 2], seed=1), 1), build_stage(tiny_run([1, 3], seed=1), 1)
    # layer 2 is in stage 1 under both splits and gets the same values regardless of its stage.
    assert torch.equal(a.blocks["2"].attn.wq.weight, b.blocks["2"].attn.wq.weight)
    assert a.state_hash() != build_stage(tiny_run([2, 2], seed=2), 1).state_hash()
    assert not torch.equal(a.blocks["2"].attn.wq.weight, a.blocks["3"].attn.wq.weight)


def test_interleaved_microbatches_accumulate_like_sequential() -> None:
    run = tiny_run([2, 2], seed=7)
    seq = [build_stage(run, s) for s in range(2)]
    inter = [build_stage(run, s) for s in range(2)]
    batches = [(tokens(10 + i), tokens(20 + i)) for i in range(3)]

    for i, (x, y) in enumerate(batches):
        seq[1](i, seq[0](i, x), y)
        seq[0].backward(i, seq[1].backward(i, None, loss_scale=1 / 3))

    # All three forward first, backward in reverse order with string ids.
    for i, (x, y) in enumerate(batches):
        inter[1](f"t{i}", inter[0](f"t{i}", x), y)
    assert inter[0].in_flight() == inter[1].in_flight() == 3
    for i in reversed(range(3)):
        inter[0].backward(f"t{i}", inter[1].backward(f"t{i}", None, loss_scale=1 / 3))

    for a, b in zip(seq, inter):
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert rel_diff(q.grad, p.grad) <= 1e-6, n


def test_discard_frees_state_and_leaves_grads_untouched() -> None:
    run = tiny_run([2, 2], seed=7)
    st = build_stage(run, 0)
    st(5, tokens(1))
    assert st.in_flight() == 1
    assert st.discard(5) is True
    assert st.discard(5) is False
    assert st.in_flight() == 0
    assert all(p.grad is None for p in st.parameters())
    with pytest.raises(MicrobatchStateError, match="no microbatch 5"):
        st.backward(5, torch.zeros(3, 16, 32))


def test_a_graph_held_across_a_parameter_update_is_refused_as_stale() -> None:
    """Issue 28: a stage-0 node held a microbatch's graph while an optimizer step updated the parameters in
    place; its late gradient then crashed the node in autograd. The backward is refused (a stale
    microbatch the router drops and the ticket is redone) and the graph freed."""
    run = tiny_run([2, 2], seed=7)
    st = build_stage(run, 0)
    opt = torch.optim.SGD(st.parameters(), lr=0.1)
    st(1, tokens(1))
    st(2, tokens(2))
    st.backward(1, torch.ones(3, 16, 32))  # a graph from before the update still backpropagates
    opt.step()
    with pytest.raises(MicrobatchStateError, match="before the parameters changed"):
        st.backward(2, torch.ones(3, 16, 32))
    assert st.in_flight() == 0
    st(3, tokens(3))
    assert st.backward(3, torch.ones(3, 16, 32)) is None  # forwarded after the update: fine


def test_infer_equals_forward_and_keeps_no_state() -> None:
    run = tiny_run([1, 3], seed=7)
    s0, s1 = build_stage(run, 0), build_stage(run, 1)
    x, y = tokens(3), tokens(4)
    h = s0.infer(x)
    assert torch.equal(h, s0(0, x))
    assert torch.equal(s1.infer(h, y), s1(0, h, y))
    assert s0.in_flight() == s1.in_flight() == 1


def test_bad_inputs_are_refused_with_the_reason() -> None:
    run = tiny_run([2, 2], seed=7)
    s0, s1 = build_stage(run, 0), build_stage(run, 1)
    with pytest.raises(StageInputError, match="outside 0..258"):
        s0(0, torch.full((2, 4), 300, dtype=torch.int64))
    with pytest.raises(StageInputError, match="int64"):
        s0(0, torch.zeros(2, 4))
    with pytest.raises(StageInputError, match="T <= 32"):
        s0(0, torch.zeros(2, 33, dtype=torch.int64))
    with pytest.raises(StageInputError, match="float32"):
        s1(0, torch.zeros(2, 4, 31), tokens(1, (2, 4)))
    with pytest.raises(StageInputError, match="needs targets"):
        s1(0, torch.zeros(2, 4, 32))
    with pytest.raises(StageInputError, match="targets shape"):
        s1(0, torch.zeros(2, 4, 32), tokens(1, (2, 5)))
    h = s0(1, tokens(1, (2, 4)))
    with pytest.raises(StageInputError, match="grad_output"):
        s0.backward(1, torch.zeros(2, 5, 32))
    with pytest.raises(StageInputError, match="no LM head"):
        s0.logits(tokens(1, (2, 4)))
    with pytest.raises(MicrobatchStateError, match="already in flight"):
        s0(1, tokens(1, (2, 4)))
    assert s0.backward(1, torch.ones_like(h)) is None
    assert s0.in_flight() == 0


def test_param_names_are_global_and_sorted() -> None:
    run = tiny_run([1, 2, 1], seed=7)
    names = build_stage(run, 1).param_names()
    assert names == sorted(names)
    assert {n.split(".")[1] for n in names} == {"1", "2"}
    assert "embed.weight" in build_stage(run, 0).param_names()
    assert "head.out.weight" in build_stage(run, 2).param_names()
