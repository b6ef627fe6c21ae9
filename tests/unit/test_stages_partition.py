"""Partition plans: contiguous, complete, balanced, and consistent with the config."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protolearn.errors import ConfigError
from protolearn.stages.config import RunConfig
from protolearn.stages.partition import PartitionPlan, even_split


@st.composite
def layer_lists(draw: st.DrawFn) -> list[int]:
    return draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))


@given(n_layers=st.integers(1, 64), data=st.data())
def test_even_split_is_balanced_and_complete(n_layers: int, data: st.DataObject) -> None:
    s = data.draw(st.integers(1, n_layers))
    split = even_split(n_layers, s)
    assert len(split) == s and sum(split) == n_layers
    assert max(split) - min(split) <= 1
    assert split == sorted(split, reverse=True)  # earlier stages take the remainder


@given(layers=layer_lists())
def test_layer_ranges_tile_the_model_in_order(layers: list[int]) -> None:
    plan = PartitionPlan(tuple(layers))
    covered: list[int] = []
    for s in range(plan.num_stages):
        r = plan.layer_range(s)
        assert len(r) == layers[s]
        covered.extend(r)
        assert all(plan.stage_of_layer(i) == s for i in r)
    assert covered == list(range(plan.n_layers))
    assert plan.is_first(0) and plan.is_last(plan.num_stages - 1)
    assert sum(plan.is_first(s) for s in range(plan.num_stages)) == 1
    assert sum(plan.is_last(s) for s in range(plan.num_stages)) == 1


@given(layers=layer_lists())
def test_from_config_uses_the_given_layers(layers: list[int]) -> None:
    run = RunConfig.model_validate(
        {"model": {"n_layers": sum(layers)}, "stages": {"num_stages": len(layers), "layers": layers}}
    )
    assert PartitionPlan.from_config(run).layers == tuple(layers)


def test_from_config_defaults_to_even_split() -> None:
    run = RunConfig.model_validate({"model": {"n_layers": 7}, "stages": {"num_stages": 3}})
    plan = PartitionPlan.from_config(run)
    assert [list(plan.layer_range(s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]


def test_out_of_range_stage_and_impossible_split() -> None:
    plan = PartitionPlan((2, 2))
    with pytest.raises(ValueError, match="stages 0..1"):
        plan.layer_range(2)
    with pytest.raises(ConfigError, match="cannot split 3 layers into 4 stages"):
        even_split(3, 4)
    with pytest.raises(ConfigError):
        PartitionPlan((2, 0))
