"""Adversaries for testing integrity: a node that lies on purpose (``node join --adversary KIND[:from_step]``).

It works only when the environment sets ``PROTOLEARN_ALLOW_ADVERSARY=1``, so no user trips over it.
From optimizer step ``from_step`` on, the node misbehaves in one way:

- ``scale``, ``noise``, ``signflip``, ``zero``, ``random``, ``nan``: every activation and gradient it
  sends is corrupted (:meth:`Adversary.corrupt`, before encoding), and it signs the corrupted tensor as
  its own: x10; plus Gaussian noise of the tensor's RMS; negated; zeros; a Gaussian of the same RMS
  (norm-preserving, structure-free); NaN in 1% of the elements. The int8 and topk encoders refuse NaN,
  so under those codecs a ``nan`` liar fails to send rather than sending NaN;
- ``stale``: it serves outputs computed with the weights it had at ``from_step``;
- ``reducer``: it corrupts the parts it reduces in the collective;
- ``blackhole``: it accepts leases and activations and never answers, while it keeps heartbeating.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protolearn.errors import ConfigError
from protolearn.protocol.monitors import DIRECTIONS

ENV = "PROTOLEARN_ALLOW_ADVERSARY"
TENSOR_KINDS = ("scale", "noise", "signflip", "zero", "random", "nan")
KINDS = TENSOR_KINDS + ("stale", "reducer", "blackhole")
# How hard the tensor kinds lie: ``scale`` multiplies by SCALE_FACTOR; ``nan`` poisons NAN_FRACTION of
# the elements (at least one). ``noise`` adds, and ``random`` substitutes, Gaussian noise of the tensor's RMS.
SCALE_FACTOR = 10.0
NAN_FRACTION = 0.01


@dataclass(frozen=True)
class Adversary:
    kind: str
    from_step: int = 0
    seed: int = 0

    def active(self, step: int) -> bool:
        return step >= self.from_step

    @property
    def corrupts_tensors(self) -> bool:
        return self.kind in TENSOR_KINDS

    def corrupt(self, t: torch.Tensor, *, step: int, ticket: int, direction: str) -> torch.Tensor:
        """The lie this adversary sends instead of ``t`` (an activation ``fwd`` or a gradient ``bwd``).

        A new tensor; ``t`` is never modified. The same (seed, step, ticket, direction) gives the same
        lie, from a local generator, so tests replay and the global RNG of training is untouched.
        Non-tensor kinds return ``t`` itself; whether the adversary is already :meth:`active` is the
        caller's check.
        """
        if self.kind not in TENSOR_KINDS:
            return t
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        x = t.detach()
        if self.kind == "scale":
            return x * SCALE_FACTOR
        if self.kind == "signflip":
            return -x
        if self.kind == "zero":
            return torch.zeros_like(x)
        gen = torch.Generator(device="cpu").manual_seed(_lie_seed(self.seed, step, ticket, direction))
        if self.kind == "nan":
            out = x.clone()
            flat = out.view(-1)
            count = max(1, round(NAN_FRACTION * flat.numel())) if flat.numel() else 0
            idx = torch.randperm(flat.numel(), generator=gen)[:count].to(flat.device)
            flat[idx] = float("nan")
            return out
        # noise / random: Gaussian with the tensor's RMS (float32 on the CPU generator, then t's dtype/device)
        rms = torch.linalg.vector_norm(x.float()) / max(1, x.numel()) ** 0.5
        g = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device) * rms
        if self.kind == "noise":
            return (x.float() + g).to(x.dtype)
        return g.to(x.dtype)  # random: norm-preserving, structure-free


def _lie_seed(seed: int, step: int, ticket: int, direction: str) -> int:
    digest = hashlib.sha256(f"protolearn-adversary/{seed}/{step}/{ticket}/{direction}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def parse_adversary(spec: str, env: Mapping[str, str] | None = None) -> Adversary:
    """``KIND[:from_step]`` → :class:`Adversary`; a ConfigError (one line) when not allowed or malformed."""
    env = os.environ if env is None else env
    if env.get(ENV) != "1":
        raise ConfigError(f"--adversary makes this node attack the swarm, for testing only; set {ENV}=1 to allow it")
    kind, _, start = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--adversary {spec!r}: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    try:
        from_step = int(start) if start else 0
    except ValueError:
        from_step = -1
    if from_step < 0:
        raise ConfigError(f"--adversary {spec!r}: from_step must be a step number >= 0, as in {kind}:5")
    return Adversary(kind, from_step)
