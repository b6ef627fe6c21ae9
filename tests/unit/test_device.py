"""``--device``: every name a node accepts, and one clear line for a device this machine does not have."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from protolearn.errors import ConfigError
from protolearn.node.config import NodeConfig
from protolearn.node.join import resolve_device

ADDR = "/ip4/127.0.0.1/tcp/7700/p2p/12D3KooWLtmWBffp4nFR617coSMPgcuXAjkp2AZYcRQ6ESJFKjAd"


def test_device_names_are_checked_when_the_config_is_built(tmp_path) -> None:
    for ok in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert NodeConfig(coordinator=ADDR, data_dir=tmp_path, device=ok).device == ok
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda1", "tpu:0"):
        with pytest.raises(ValidationError, match="is not a device"):
            NodeConfig(coordinator=ADDR, data_dir=tmp_path, device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_device_torch_does_not_see_is_one_line() -> None:
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for missing in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"--device {missing} was given but torch sees no CUDA device") as err:
            resolve_device(missing)
        assert "\n" not in str(err.value)
    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match="--device mps was given but torch sees no MPS device"):
            resolve_device("mps")


def test_max_memory_takes_a_size_with_its_unit(tmp_path) -> None:
    assert NodeConfig(coordinator=ADDR, data_dir=tmp_path, max_memory="8GB").max_memory == 8 * 10**9
    with pytest.raises(ValidationError, match="is not a size"):
        NodeConfig(coordinator=ADDR, data_dir=tmp_path, max_memory="8")
