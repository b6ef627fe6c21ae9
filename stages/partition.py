"""The partition plan: which contiguous transformer layers each pipeline stage holds.

Stage 0 also holds the token embedding and the last stage the final norm and the LM head. Layer
indices are global (0 .. n_layers-1), so a parameter has the same name in a stage and in the whole
model. The even split gives the remainder to the earliest stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from protolearn.errors import ConfigError

if TYPE_CHECKING:
    from protolearn.stages.config import RunConfig


def even_split(n_layers: int, num_stages: int) -> list[int]:
    """Layers per stage for an even split; sizes differ by at most one, earlier stages larger."""
    if not 1 <= num_stages <= n_layers:
        raise ConfigError(f"cannot split {n_layers} layers into {num_stages} stages; need 1 <= stages <= layers")
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


@dataclass(frozen=True)
class PartitionPlan:
    """Layers per stage, in stage order."""

    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers):
            raise ConfigError(f"partition {list(self.layers)} needs at least one stage and >= 1 layer per stage")

    @classmethod
    def from_config(cls, run: RunConfig) -> PartitionPlan:
        layers = run.stages.layers or even_split(run.model.n_layers, run.stages.num_stages)
        return cls(tuple(layers))

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def n_layers(self) -> int:
        return sum(self.layers)

    def _check(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range; this run has stages 0..{self.num_stages - 1}")

    def layer_range(self, stage: int) -> range:
        """The global layer indices of ``stage``."""
        self._check(stage)
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])

    def stage_of_layer(self, layer: int) -> int:
        """The stage that holds global layer ``layer``."""
        for stage in range(self.num_stages):
            if layer in self.layer_range(stage):
                return stage
        raise ValueError(f"layer {layer} is out of range; the model has layers 0..{self.n_layers - 1}")

    def is_first(self, stage: int) -> bool:
        self._check(stage)
        return stage == 0

    def is_last(self, stage: int) -> bool:
        self._check(stage)
        return stage == self.num_stages - 1
