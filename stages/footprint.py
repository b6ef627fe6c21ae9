"""How much memory one replica of a stage needs: the estimate the coordinator places nodes by.

Pure arithmetic on the run config (no torch), so the coordinator computes it without a model. A node
reports the memory it offers at join (``--max-memory``, or on CUDA the device's free memory) and the
coordinator gives it only a stage whose :func:`stage_footprint` fits (``coordinator/core/fit.py``).

With ``P`` the stage's parameters, ``B`` the microbatches per step, ``N = microbatch_size × seq_len``
the tokens of one microbatch, ``D``/``F``/``H``/``V`` the model's width, MLP width, heads and
vocabulary, and every tensor float32 (4 bytes), a replica holds at its peak the larger of two phases:

- **pipeline** (the step's microbatches pass through): the parameters ``4P``, AdamW's two moments
  ``8P``, the collective results of the two previous steps that it keeps for late fetchers
  (``node/finished_rounds.py``: ``8P``), the per-ticket parameter gradients of every ticket of the step
  in the worst case (``node/worker.py``: ``B × 4P``), the autograd graphs of ``g`` microbatches and the
  working space of one backward (``W``). A graph is held from a microbatch's forward until its
  gradient comes back, so ``g = min(B, max_in_flight)`` on every stage but the last, which runs
  forward and backward of a microbatch at once (``g = 0``; its one microbatch is in ``W``);
- **averaging** (the step closes): parameters, moments, ticket gradients and kept results as above,
  plus the summed vector ``4P``, the slices the collective receives with its cross-check (``8P`` at
  most) and the new result ``4P``.

One microbatch's graph (``A``) is what autograd saves, counted from ``stages/model.py``: per block
11 tensors of ``N × D`` (the two RMSNorms' normalised input and output, the value projection, the
rotated query and key, the attention output and its reshaped copy, the residual after attention, and
the block's output) and 4 of ``N × F`` (SwiGLU's gate, its SiLU, the up projection and their product),
plus ``N × (H + 2)`` norm and softmax statistics; the stage's input (the embedding output on stage 0,
the received hidden elsewhere) is one more ``N × D``. ``W`` is one backward's gradient buffers
(``3 N × F + 4 N × D``) and, on the last stage, the head: its norm (``2 N × D``), the logits, their
log-softmax and its gradient (``3 N × V``).

Checked against the peak resident growth of one CPU replica running the node's own compute
(``tests/integration/test_footprint_peak.py``, through ``tests/integration/footprint_probe.py``): on the demo run the estimate
is between 3% below and 20% above the measured peak (stage 0 at max_in_flight 8 and 2, the last stage, in nine
runs), the probe running the worst case counted here (the last step's ticket gradients still held while the
next step's first graphs are). Under bf16 autocast the estimate is the same (not measured separately: matmul outputs
are bf16, but the residual stream and the norms stay float32, and autocast caches bf16 weight copies). On
CUDA, the averaging buffers and kept results live in host memory, so a GPU node's estimate errs high.
"""

from __future__ import annotations

from dataclasses import dataclass

from protolearn.stages.config import RunConfig
from protolearn.stages.partition import PartitionPlan

FLOAT_BYTES = 4
GB = 1e9


@dataclass(frozen=True)
class StageFootprint:
    """The memory terms of one replica of ``stage``, in bytes (see the module docstring)."""

    stage: int
    params: int  # parameter count P
    persistent: int  # parameters, moments and the two kept results: 4P + 8P + 8P
    ticket_grads: int  # B × 4P
    averaging: int  # summed vector, received slices and the new result: 16P
    graph: int  # one held microbatch's autograd graph, A
    working: int  # one backward's working space, W
    holds_graphs: bool  # False on the last stage (forward and backward at once)
    microbatches_per_step: int

    def graphs(self, max_in_flight: int) -> int:
        """Microbatch graphs held at once with ``max_in_flight``: never more than one per ticket of the step."""
        return min(self.microbatches_per_step, max(1, max_in_flight)) if self.holds_graphs else 0

    def activations(self, max_in_flight: int) -> int:
        return self.graphs(max_in_flight) * self.graph + self.working

    def total(self, max_in_flight: int) -> int:
        """The peak bytes of a replica that lets ``max_in_flight`` microbatches in at once."""
        pipeline = self.persistent + self.ticket_grads + self.activations(max_in_flight)
        return max(pipeline, self.persistent + self.ticket_grads + self.averaging)

    def describe(self, max_in_flight: int) -> str:
        """Its terms in words, for the one line a node that does not fit gets."""
        g = self.graphs(max_in_flight)
        held = f"{g} microbatch graph{'s' if g != 1 else ''} ({g * self.graph / GB:.2f} GB) and" if self.holds_graphs else "one microbatch's"
        return (
            f"{(self.persistent + self.ticket_grads) / GB:.2f} GB of parameters, optimizer state and gradients, "
            f"{held} working space ({self.working / GB:.2f} GB)"
        )


def stage_params(run: RunConfig, stage: int) -> int:
    """The parameter count of ``stage`` (as ``stages/model.py`` builds it)."""
    m = run.model
    d, f, v = m.d_model, m.d_ff, m.vocab_size
    plan = PartitionPlan.from_config(run)
    block = 4 * d * d + 3 * d * f + 2 * d  # attention q, k, v, o; SwiGLU w1, w2, w3; two RMSNorm gains
    n = plan.layers[stage] * block
    if stage == 0:
        n += v * d  # the token embedding
    if stage == plan.num_stages - 1:
        n += d + d * v  # the final norm and the LM head
    return n


def stage_footprint(run: RunConfig, stage: int) -> StageFootprint:
    """The memory terms of ``stage`` of ``run`` (see the module docstring for the formula)."""
    m, b = run.model, run.batch
    plan = PartitionPlan.from_config(run)
    last = stage == plan.num_stages - 1
    p = stage_params(run, stage)
    n = b.microbatch_size * b.seq_len  # tokens of one microbatch
    d, f = m.d_model, m.d_ff
    per_block = 11 * n * d + 4 * n * f + n * (m.n_heads + 2)
    graph = (plan.layers[stage] * per_block + n * d) * FLOAT_BYTES
    working = (3 * n * f + 4 * n * d) * FLOAT_BYTES
    if last:
        working += graph + (2 * n * d + 3 * n * m.vocab_size) * FLOAT_BYTES
    return StageFootprint(
        stage=stage, params=p, persistent=20 * p, ticket_grads=b.microbatches_per_step * 4 * p, averaging=16 * p,
        graph=graph, working=working, holds_graphs=not last, microbatches_per_step=b.microbatches_per_step,
    )


def stage_footprints(run: RunConfig) -> tuple[StageFootprint, ...]:
    return tuple(stage_footprint(run, s) for s in range(run.stages.num_stages))
