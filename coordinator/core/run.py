"""The run as the coordinator sees it: its name, hash and config text, and the shape of its pipeline.

The coordinator needs no model: only the layers per stage (for the stage shares), the microbatches
per step (the tickets), the tokens per step (for tokens/s) and the vocabulary size (a plausible loss). :meth:`RunInfo.from_run` reads them off
a :class:`~protolearn.stages.config.RunConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protolearn.coordinator.core.outer_rounds import OuterSpec
from protolearn.stages.footprint import StageFootprint


@dataclass(frozen=True)
class RunInfo:
    """What the coordinator needs to know about the run."""

    name: str
    run_hash: str
    run_toml: str
    layers: tuple[int, ...]
    microbatches_per_step: int
    tokens_per_step: int
    # The run's optimizer steps (0: not said): the run is finished once step ``steps - 1`` committed.
    steps: int = 0
    # The model's vocabulary (bounds a plausible loss); 0: unknown, no upper bound beyond finiteness.
    vocab_size: int = 0
    # What a spot check's evidence is checked against (coordinator/core/integrity.py): the boundary tensor's
    # shape (mb, T, D), the run's codec and the relative tolerance beyond the codec's own error.
    boundary_shape: tuple[int, ...] = ()
    codec: str = "none"
    check_tolerance: float = 1e-3
    # The precisions the run admits (protolearn/precision.py): a join declaring another is refused, and
    # evidence is judged with their allowance.
    precisions: tuple[str, ...] = ("fp32",)
    # The collective's aggregation (a reducer's proof is checked against it): as IntegrityConfig names them.
    aggregation: str = "mean"
    trim_fraction: float = 0.25
    clip_tau: float = 1.0
    clip_iters: int = 3
    # The replicas' sync compression (protolearn/sync_spec.py): part of a compressed round's reduction.
    sync_compression: str = "none"
    # The run's subspace (protolearn/subspace.py) as (seed, vocab_size, d_model, rank, init_std), None
    # without one: what decodes a ``subspace`` frame in evidence.
    subspace: tuple[int, int, int, int, float] | None = None
    # Each stage's memory footprint (stages/footprint.py): a joiner goes only where it fits (fit.py).
    footprints: tuple[StageFootprint, ...] = ()
    # DiLoCo mode's outer rounds (coordinator/core/outer_rounds.py); None: the replicas average every step.
    outer: OuterSpec | None = None
    # What a departed replica's tickets become (the run's batch.departures): "redo" or "drop" (tickets.py).
    departures: str = "redo"
    # When a step closes (batch.close_quorum, batch.close_grace; coordinator/core/close_rule.py): 1.0 = every ticket done.
    close_quorum: float = 1.0
    close_grace: float = 0.25

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @classmethod
    def from_run(cls, run) -> RunInfo:  # run: protolearn.stages.config.RunConfig
        from protolearn.stages.footprint import stage_footprints
        from protolearn.stages.partition import PartitionPlan

        return cls(
            name=run.name,
            run_hash=run.run_hash(),
            run_toml=run.to_toml(),
            layers=tuple(PartitionPlan.from_config(run).layers),
            microbatches_per_step=run.batch.microbatches_per_step,
            tokens_per_step=run.batch.tokens_per_step,
            steps=run.steps,
            vocab_size=run.model.vocab_size,
            boundary_shape=(run.batch.microbatch_size, run.batch.seq_len, run.model.d_model),
            codec=run.codec,
            check_tolerance=run.integrity.check_tolerance,
            precisions=tuple(run.integrity.precisions),
            aggregation=run.integrity.aggregation,
            trim_fraction=run.integrity.trim_fraction,
            clip_tau=run.integrity.clip_tau,
            clip_iters=run.integrity.clip_iters,
            sync_compression=run.sync.compression,
            subspace=run.subspace_key,
            footprints=stage_footprints(run),
            outer=_outer_spec(run),
            departures=run.batch.departures,
            close_quorum=run.batch.close_quorum,
            close_grace=run.batch.close_grace,
        )


def _outer_spec(run) -> OuterSpec | None:
    sync = run.sync
    if not sync.diloco:
        return None
    return OuterSpec(
        inner_steps=sync.inner_steps, steps=run.steps, quorum=sync.quorum, grace_s=sync.grace_s, max_weight_share=sync.max_weight_share,
        tokens_per_ticket=run.batch.microbatch_size * run.batch.seq_len,
    )
