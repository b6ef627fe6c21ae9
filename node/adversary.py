"""Adversaries for testing integrity: a node that lies on purpose (``node join --adversary KIND[:from_step]``).

It works only when the environment sets ``PROTOLEARN_ALLOW_ADVERSARY=1``, so no user trips over it.
From optimizer step ``from_step`` on, the node misbehaves in one way:

- ``scale``, ``noise``, ``signflip``, ``zero``, ``random``, ``nan``: every activation and gradient it
  sends is corrupted (:meth:`Adversary.corrupt`), and it signs the corrupted tensor as its own;
- ``stale``: it serves outputs computed with the weights it had at ``from_step``;
- ``reducer``: it corrupts the parts it reduces in the collective;
- ``blackhole``: it accepts leases and activations and never answers, while it keeps heartbeating.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from protolearn.errors import ConfigError

ENV = "PROTOLEARN_ALLOW_ADVERSARY"
TENSOR_KINDS = ("scale", "noise", "signflip", "zero", "random", "nan")
KINDS = TENSOR_KINDS + ("stale", "reducer", "blackhole")


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
