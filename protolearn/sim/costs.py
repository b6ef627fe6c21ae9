"""What work costs in a simulated swarm: seconds of compute from the model's FLOPs, bytes from the codecs.

Pure arithmetic on the run config, the same config the coordinator core gets:

- **Compute.** A stage's parameters are :func:`~protolearn.stages.footprint.stage_params`'s count. A
  forward pass costs 2 FLOPs per parameter per token, plus attention's ``4 T D`` per token and layer
  (scores and the weighted sum over a sequence of T) and, on the last stage, the head's ``2 D V`` per
  token that is already in its parameter count. A backward costs twice the forward (the input and the
  weight gradients). A node's time is FLOPs over its effective (achieved) TFLOPS.
- **Boundary bytes.** What one microbatch's activation (``fwd``) or activation gradient (``bwd``) costs on
  the wire in the run's codec: :func:`boundary_bytes_per_token` per token, checked against the real
  encoders in ``tests/unit/test_sim_costs.py``.
- **Replica sync.** The collective averages a flat vector of the stage's parameters, ``4 P`` bytes per
  replica in float32 or less under a replica-sync compression (:func:`sync_bytes_per_param`), cut into
  one part per participant.
- **State.** A joiner downloads the stage's parameters and both AdamW moments (``12 P`` bytes).

:func:`transfer` times a message between two nodes' links (:class:`~protolearn.protocol.link.LinkSpec`): the
sender's up direction and the receiver's down direction are each a token bucket at the link's rate
(:class:`~protolearn.protocol.link.TokenBucket`, the link emulation's own model) plus the one-way delays.
A large message streams through both buckets at once, so it is limited by the slower of the two, not
serialised twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from protolearn.protocol.link import TokenBucket
from protolearn.stages.config import RunConfig
from protolearn.stages.footprint import stage_params
from protolearn.stages.partition import PartitionPlan

FLOAT_BYTES = 4
# Frame and message overhead per tensor message (header, route, signatures), measured on the demo run's frames.
MESSAGE_OVERHEAD_BYTES = 600


def boundary_bytes_per_token(run: RunConfig, direction: str) -> float:
    """Wire bytes per token of a boundary tensor (fwd: activation, bwd: its gradient) in ``run``'s codec."""
    spec = run.codec_spec
    d = run.model.d_model
    if spec.name == "subspace":
        k = run.subspace.rank or d
        inner = _dense_bytes_per_token(spec.inner or "fp16", k)
        ids = (2 if run.model.vocab_size <= 32768 else 4) if direction == "fwd" else 0
        return inner + ids
    if spec.name == "topk":
        fraction = spec.fraction or 0.05
        return fraction * d * (FLOAT_BYTES + 4)  # a value and an int32 index per kept element
    return _dense_bytes_per_token(spec.name, d)


def _dense_bytes_per_token(codec: str, d: int) -> float:
    if codec in ("fp16", "bf16"):
        return 2.0 * d
    if codec == "int8":
        return d + FLOAT_BYTES  # one byte per element and a float32 scale per row (token)
    return FLOAT_BYTES * d


def sync_bytes_per_param(run: RunConfig, compression: str) -> float:
    """Bytes a replica sends into its stage's average per parameter, under the replica-sync ``compression``:
    ``none`` (float32), ``int8`` (a byte and a float32 scale per block of 256), ``topk:F`` (a value and an
    int32 index per kept entry) or ``powersgd:R`` (rank-R factors of each block matrix, the rest raw)."""
    name, _, arg = compression.partition(":")
    if name == "none":
        return float(FLOAT_BYTES)
    if name == "int8":
        return 1.0 + FLOAT_BYTES / 256
    if name == "topk":
        return float(arg or 0.01) * (FLOAT_BYTES + 4)
    if name == "powersgd":
        r = int(arg or 4)
        d, f = run.model.d_model, run.model.d_ff
        dense = 4 * d * d + 3 * d * f
        factors = 4 * r * (d + d) + 3 * r * (d + f)
        return FLOAT_BYTES * factors / dense
    raise ValueError(f"unknown replica-sync compression {compression!r}: use none, int8, topk:F or powersgd:R")


@dataclass(frozen=True)
class StageCosts:
    """The per-microbatch costs of one stage of the run, in FLOPs and bytes."""

    stage: int
    params: int
    fwd_flops: float  # one microbatch's forward through the stage
    bwd_flops: float
    fwd_bytes: int  # the activation this stage sends on (0 on the last stage)
    bwd_bytes: int  # the gradient this stage sends back (0 on stage 0)
    sync_bytes: int  # the vector a replica averages
    state_bytes: int  # what a joiner downloads


@dataclass(frozen=True)
class RunCosts:
    """Costs of every stage of ``run``."""

    run: RunConfig
    stages: tuple[StageCosts, ...]
    tokens_per_microbatch: int

    @classmethod
    def of(cls, run: RunConfig, sync_compression: str = "none") -> RunCosts:
        plan = PartitionPlan.from_config(run)
        m, b = run.model, run.batch
        tokens = b.microbatch_size * b.seq_len
        out = []
        for s in range(plan.num_stages):
            p = stage_params(run, s)
            attention = 4.0 * b.seq_len * m.d_model * plan.layers[s]
            fwd = tokens * (2.0 * p + attention)
            last = s == plan.num_stages - 1
            fwd_bytes = 0 if last else int(tokens * boundary_bytes_per_token(run, "fwd")) + MESSAGE_OVERHEAD_BYTES
            bwd_bytes = 0 if s == 0 else int(tokens * boundary_bytes_per_token(run, "bwd")) + MESSAGE_OVERHEAD_BYTES
            sync = int(p * sync_bytes_per_param(run, sync_compression))
            out.append(StageCosts(s, p, fwd, 2.0 * fwd, fwd_bytes, bwd_bytes, sync, 3 * FLOAT_BYTES * p))
        return cls(run, tuple(out), tokens)


class Wire:
    """One node's access link as two token buckets and a one-way delay each way."""

    __slots__ = ("up", "down", "delay_s", "up_rate", "down_rate")

    def __init__(self, up_bytes_per_s: float, down_bytes_per_s: float, delay_s: float, burst: float = 16 * 1024) -> None:
        self.up = TokenBucket(up_bytes_per_s, burst)
        self.down = TokenBucket(down_bytes_per_s, burst)
        self.up_rate = up_bytes_per_s
        self.down_rate = down_bytes_per_s
        self.delay_s = delay_s


def transfer(src: Wire, dst: Wire, nbytes: int, now: float) -> float:
    """When ``nbytes`` sent by ``src`` at ``now`` have all arrived at ``dst`` (both links queue FIFO)."""
    left_src = src.up.reserve(nbytes, now)
    # The first bytes reach dst's link one delay after they leave; dst's bucket then drains them at its rate.
    left_dst = dst.down.reserve(nbytes, now + src.delay_s)
    return max(left_src + src.delay_s, left_dst) + dst.delay_s


def round_trip_s(a: Wire, b: Wire) -> float:
    return 2.0 * (a.delay_s + b.delay_s)
