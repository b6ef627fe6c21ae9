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
- ``blackhole``: it accepts leases and activations and never answers, while it keeps heartbeating;
- ``hang``: its compute hangs, as a stuck GPU kernel or driver does: from ``from_step`` on, the first
  forward or backward it starts never returns (:class:`HangingWorker`), while its event loop,
  heartbeats and connections stay up. It hangs only a kind of call it has already completed a few
  times (the watchdog's ``min_samples``), so that its own watchdog judges the hang by measured times; a
  device hung from its first call is judged against ``first_s`` (two minutes), which no test waits out.

The attack reaches the swarm from outside the production classes: :class:`Attack` builds the node's
outbound filter (:class:`Lying`, a :class:`~protolearn.node.outbound.Outbound` that the router, integrity,
the averager and the driver get in their constructors) and, for ``stale``, its worker
(:class:`StaleWorker`). Every lie sent is an ``adversary`` progress event with the running count
(``sent``), which the integrity benchmark counts up to the ban.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from protolearn.errors import ConfigError
from protolearn.protocol.monitors import DIRECTIONS
from protolearn.node.core.watchdog import Watchdog
from protolearn.node.outbound import Outbound
from protolearn.node.progress import Progress
from protolearn.node.worker import StageWorker
from protolearn.stages.config import RunConfig
from protolearn.stages.stage import StageModule

log = logging.getLogger("protolearn.node")

ENV = "PROTOLEARN_ALLOW_ADVERSARY"
TENSOR_KINDS = ("scale", "noise", "signflip", "zero", "random", "nan")
KINDS = TENSOR_KINDS + ("stale", "reducer", "blackhole", "hang")
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


class Attack:
    """What a node started with ``--adversary`` builds instead of the honest parts, for each stage it
    builds; it counts the lies sent across those builds."""

    def __init__(self, adversary: Adversary, progress: Progress) -> None:
        self.adversary = adversary
        self.progress = progress
        self.sent = 0

    def worker(self, run: RunConfig, stage: int, device: str, *, bf16_autocast: bool) -> StageWorker:
        if self.adversary.kind == "stale":
            return StaleWorker(run, stage, device, bf16_autocast=bf16_autocast, from_step=self.adversary.from_step)
        if self.adversary.kind == "hang":
            return HangingWorker(run, stage, device, bf16_autocast=bf16_autocast, from_step=self.adversary.from_step)
        return StageWorker(run, stage, device, bf16_autocast=bf16_autocast)

    def outbound(self, worker: StageWorker) -> Outbound:
        """The filter of the stage ``worker`` computes for (built by :meth:`worker`)."""
        adv = self.adversary
        log.warning("adversary armed: %s from step %d", adv.kind, adv.from_step)
        return Lying(self, worker)

    def count(self, **fields: Any) -> None:
        """One lie sent: say so on the event log, with the running count."""
        self.sent += 1
        self.progress.event("adversary", kind=self.adversary.kind, **fields, sent=self.sent)


class Lying(Outbound):
    """The outbound filter of an :class:`Attack` (see the module docstring for what each kind does)."""

    def __init__(self, attack: Attack, worker: StageWorker) -> None:
        self.attack = attack
        self.adversary = attack.adversary
        self.worker = worker
        if self.adversary.kind == "reducer":
            self.part_filter = self._corrupt_part

    def tensor(self, t: torch.Tensor, step: int, ticket: int, direction: str, *, check: bool = False) -> torch.Tensor:
        adv = self.adversary
        if adv.corrupts_tensors:
            if not adv.active(step):
                return t
            self.attack.count(step=step, ticket=ticket, direction=direction)
            return adv.corrupt(t, step=step, ticket=ticket, direction=direction)
        # A stale liar's pipeline outputs come from its old weights (its worker's doing); its check results do not.
        if adv.kind == "stale" and not check and isinstance(self.worker, StaleWorker) and self.worker.serving_old_weights:
            self.attack.count(step=step, ticket=ticket, direction=direction)
        return t

    def _corrupt_part(self, part: int, data: torch.Tensor) -> torch.Tensor:
        self.attack.count(part=part)
        return data + 1.0

    def withholds(self, step: int) -> bool:
        return self.adversary.kind == "blackhole" and self.adversary.active(step)


class StaleWorker(StageWorker):
    """The ``stale`` liar's worker: once it has applied ``from_step`` steps, the activations and (on the
    last stage) the gradients it sends are computed with a frozen copy of the weights it had then, while
    it trains on; its spot-check recomputations use the current weights."""

    def __init__(self, run: RunConfig, stage: int, device: str = "cpu", *, bf16_autocast: bool = False, from_step: int) -> None:
        super().__init__(run, stage, device, bf16_autocast=bf16_autocast)
        self.from_step = from_step
        self._frozen: StageModule | None = None

    @property
    def serving_old_weights(self) -> bool:
        return self._frozen is not None

    def forward(self, key: Hashable, inputs: torch.Tensor) -> torch.Tensor:
        out = super().forward(key, inputs)
        if self._frozen is None:
            return out
        with self._ctx():
            return self._frozen.infer(inputs).float().cpu()

    def forward_backward_last(self, key: Hashable, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor | None]:
        loss, grad = super().forward_backward_last(key, inputs, targets)
        if self._frozen is not None and not self.first:  # the gradient it sends comes from the old weights
            grad = self._input_grad(self._frozen, inputs, targets, None).float().cpu()
        return loss, grad

    @torch.no_grad()
    def apply(self, step: int, flat: torch.Tensor) -> tuple[str, float]:
        out = super().apply(step, flat)
        if self._frozen is None and self.applied >= self.from_step:
            held, self.module._in_flight = self.module._in_flight, {}  # graphs of microbatches in flight do not copy
            try:
                self._frozen = copy.deepcopy(self.module)
            finally:
                self.module._in_flight = held
        return out


class HangingWorker(StageWorker):
    """The ``hang`` adversary's worker: once it has applied ``from_step`` steps, the next forward or
    backward blocks its compute thread for good (until :meth:`release`, which only tests call), as a hung
    device does. Nothing else about the node changes: its event loop keeps heartbeating and serving."""

    def __init__(self, run: RunConfig, stage: int, device: str = "cpu", *, bf16_autocast: bool = False, from_step: int,
                 after_calls: int = Watchdog.min_samples) -> None:
        super().__init__(run, stage, device, bf16_autocast=bf16_autocast)
        self.from_step = from_step
        self.after_calls = after_calls
        self._done: dict[str, int] = {"forward": 0, "backward": 0}  # completed calls, by the watchdog's kinds
        self._never = threading.Event()
        self.hung = threading.Event()  # set once a call is stuck, for tests that wait on it

    def release(self) -> None:
        self._never.set()

    def _maybe_hang(self, kind: str) -> None:
        if self.applied >= self.from_step and self._done[kind] >= self.after_calls and not self._never.is_set():
            log.warning("adversary hang: compute blocked at applied step %d", self.applied)
            self.hung.set()
            self._never.wait()

    def forward(self, key: Hashable, inputs: torch.Tensor) -> torch.Tensor:
        self._maybe_hang("forward")
        out = super().forward(key, inputs)
        self._done["forward"] += 1
        return out

    def forward_backward_last(self, key: Hashable, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor | None]:
        self._maybe_hang("backward")
        out = super().forward_backward_last(key, inputs, targets)
        self._done["backward"] += 1
        return out

    def backward(self, key: Hashable, grad_output: torch.Tensor) -> torch.Tensor | None:
        self._maybe_hang("backward")
        out = super().backward(key, grad_output)
        self._done["backward"] += 1
        return out
