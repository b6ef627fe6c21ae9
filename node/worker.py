"""The compute side of a node: one stage module, its optimizer, and the work that runs in a thread.

Every method of :class:`StageWorker` that touches tensors is meant to run through
``trio.to_thread.run_sync`` with the node's single compute limiter, so the event loop keeps reading
streams (yamux resets a stream whose reader pauses for 5 s) and no two torch calls race on the
module. Tensors handed in and out live on the CPU; the worker moves them to and from its device.
With ``bf16_autocast`` it computes under bf16 autocast on its device, the CPU included (so the
mixed-precision path runs in tests here); what the run allows for that is ``protolearn/precision.py``.

Parameter gradients are kept **per ticket** until the step closes: each backward runs with empty
``.grad`` and its result is moved into a per-ticket store. At step close the node sums exactly the
tickets the coordinator's frozen accounting assigns to this replica (in ticket order, so the sum is
deterministic). A ticket whose completion was refused, or whose route broke after this stage's backward,
is simply never summed; a redone ticket replaces its earlier contribution instead of adding to it (I1).
The store holds at most the step's tickets that passed through this replica: B × numel × 4 bytes in
the worst case. Gradients are exchanged with the replicas as one flat float32 vector over the
parameters in sorted name order, which every replica of the stage derives identically. The optimizer state travels by
parameter name (``param/<name>``, ``exp_avg/<name>``, ...), never by position or pickle.

In DiLoCo mode (``[sync] mode = "diloco"``) the worker also holds the stage's outer state
(:class:`OuterState`: the parameters after the last outer sync, the anchor, and the outer momentum). An
inner step (:meth:`StageWorker.apply_inner`) is this replica's own AdamW step on the mean gradient of the
tickets the accounting gives it; an outer step (:meth:`StageWorker.apply_outer`) installs
``stages/outer.py``'s Nesterov step on the averaged pseudo-gradient. What this replica serves a joiner, and
what a spot check may recompute with, is then the anchor: the one state its stage's replicas share.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch
from protolearn.node.checkpoint import OPTIM_KEYS, OUTER_KEY, Snapshot, shared_leaves, shared_state_hash
from protolearn.stages.config import RunConfig
from protolearn.stages.optim import apply_step, make_optimizer
from protolearn.stages.outer import flatten, nesterov_step, pseudo_gradient, unflatten_into
from protolearn.stages.stage import StageModule, build_stage, state_root

T = TypeVar("T")


@dataclass
class OuterState:
    """DiLoCo's state of one stage replica: the parameters after the last outer sync (``anchor``, flat
    float32 ``(N,)``, hashing to ``anchor_hash``, after ``anchor_applied`` steps), the outer momentum
    ``(N,)``, and the first inner step its current parameters cover since it took the anchor
    (``since_step``: the anchor's own step, or later for a replica that took it mid-round)."""

    anchor: torch.Tensor
    momentum: torch.Tensor
    anchor_applied: int
    anchor_hash: str
    since_step: int


class StageWorker:
    """Stage ``stage`` of ``run`` on ``device``, with the run's optimizer and per-ticket gradients."""

    def __init__(self, run: RunConfig, stage: int, device: str = "cpu", *, bf16_autocast: bool = False) -> None:
        self.run = run
        self.stage = stage
        self.device = torch.device(device)
        self.module: StageModule = build_stage(run, stage, self.device)
        self.names = self.module.param_names()
        params = dict(self.module.named_parameters())
        self.params = [params[n] for n in self.names]
        self.optimizer = make_optimizer(self.module.parameters(), run.optim)
        self.numel = sum(p.numel() for p in self.params)
        self._autocast = bf16_autocast
        # Microbatches whose graph the module holds (forward done, backward not yet).
        self._keys: set[Hashable] = set()
        # Per-ticket parameter gradients (one tensor or None per parameter), summed at step close.
        self._ticket_grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        # Optimizer steps the weights are after (the weights step ``applied``'s microbatches use); -1
        # while unknown (a state being installed). A spot check recomputes only at the checked step's weights.
        self.applied = 0
        # DiLoCo mode: the stage's outer state (None when the replicas average every step).
        self.outer: OuterState | None = None
        if run.sync.diloco:
            anchor = flatten(self.params)
            self.outer = OuterState(anchor, torch.zeros_like(anchor), 0, "", 0)
            self.outer.anchor_hash = self._anchor_hash()

    @property
    def first(self) -> bool:
        return self.module.first

    @property
    def last(self) -> bool:
        return self.module.last

    @property
    def precision(self) -> str:
        """What this worker computes in (protolearn/precision.py): what its node declares at join."""
        return "bf16" if self._autocast else "fp32"

    def _ctx(self, bf16: bool | None = None):
        """Autocast to bf16 when ``bf16`` (None: as this worker computes)."""
        on = self._autocast if bf16 is None else bf16
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if on else nullcontext()

    # -- pipeline compute ------------------------------------------------------------------------
    def forward(self, key: Hashable, inputs: torch.Tensor) -> torch.Tensor:
        """Forward a non-last stage; returns the boundary hidden ``(mb, T, D)`` float32 on the CPU.

        A redo of a microbatch whose graph is still held replaces that graph.
        """
        self.module.discard(key)
        with self._ctx():
            out = self.module(key, inputs)
        self._keys.add(key)
        return out.float().cpu()

    def forward_backward_last(self, key: Hashable, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor | None]:
        """The last stage: loss, then backward scaled by 1/B. Returns (loss, grad wrt inputs or None)."""
        self.module.discard(key)
        with self._ctx():
            loss = self.module(key, inputs, targets)
        grad = self._isolated(key, lambda: self.module.backward(key, None, loss_scale=1.0 / self.run.batch.microbatches_per_step))
        return float(loss), (None if grad is None else grad.float().cpu())

    def backward(self, key: Hashable, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Backward a non-last stage; returns the gradient for the previous stage (None on stage 0)."""
        self._keys.discard(key)
        grad = self._isolated(key, lambda: self.module.backward(key, grad_output))
        return None if grad is None else grad.float().cpu()

    def _isolated(self, key: Hashable, run):
        """Run a backward with empty ``.grad`` and file what it produced under ticket ``key``."""
        for p in self.params:
            p.grad = None
        try:
            out = run()
            grads = [p.grad for p in self.params]
        finally:
            for p in self.params:
                p.grad = None
        self._ticket_grads[key] = grads  # type: ignore[index]  # a redo replaces, never adds
        return out

    def discard(self, key: Hashable) -> bool:
        self._keys.discard(key)
        return self.module.discard(key)

    @torch.no_grad()
    def self_test(self) -> torch.Tensor:
        """This stage's output on a fixed input derived from the run seed (1 sequence of up to 16 tokens, or
        hidden states), float32 on the CPU: the next-stage hidden, or the logits on the last stage."""
        with self._ctx():
            return self._self_test_on(self.module)

    @torch.no_grad()
    def self_test_reference(self) -> torch.Tensor:
        """:meth:`self_test` computed on the CPU in float32 with this replica's parameters (a copy when they
        live on another device): what a sound device must agree with, whatever the donors said."""
        module = self.module
        if self.device.type != "cpu":
            module = build_stage(self.run, self.stage, "cpu")
            module.load_state_dict(self.module.state_dict())
        return self._self_test_on(module)

    @torch.no_grad()
    def _self_test_on(self, module: StageModule) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.run.seed ^ 0x5E1F7E57)
        t = min(16, self.run.batch.seq_len)
        if self.first:
            x = torch.randint(0, self.run.model.vocab_size, (1, t), generator=g)
        else:
            x = torch.randn((1, t, self.run.model.d_model), generator=g)
        out = module.logits(x) if self.last else module.infer(x)
        return out.float().cpu()

    def recompute(
        self, step: int, direction: str, inputs: list[torch.Tensor], targets: torch.Tensor | None, *, bf16: bool | None = None,
    ) -> torch.Tensor:
        """A spot check: this stage's output for microbatch inputs, without touching held graphs or
        parameter gradients, at the weights for ``step`` (raises ValueError when this replica's weights
        are not those). ``fwd``: the boundary hidden it sends on; ``bwd``: the gradient wrt its input
        hidden (``inputs`` = [hidden] on the last stage, with ``targets``; [hidden, grad_output] on a
        middle stage). Computed under bf16 autocast when ``bf16`` (None: as this worker computes); the
        result is float32 on the CPU."""
        if self.applied != step:
            raise ValueError(f"this replica's weights are after {self.applied} steps, not the {step} the check needs")
        if self.outer is not None and self.outer.anchor_applied != step:
            raise ValueError(f"step {step} is not the first inner step after this replica's last outer sync "
                             f"(after {self.outer.anchor_applied} steps): between syncs replicas differ")
        if direction == "fwd":
            if self.last:
                raise ValueError("the last stage sends no activations")
            with self._ctx(bf16):
                return self.module.infer(inputs[0]).float().cpu()
        if self.first:
            raise ValueError("stage 0 sends no gradients")
        return self._input_grad(self.module, inputs[0], targets, None if self.last else inputs[1], bf16=bf16).float().cpu()

    def _input_grad(
        self, module: StageModule, hidden: torch.Tensor, targets: torch.Tensor | None, grad_output: torch.Tensor | None, *,
        bf16: bool | None = None,
    ) -> torch.Tensor:
        """``module``'s gradient wrt its input hidden: of the loss scaled by 1/B on the last stage, else the
        vector-Jacobian product with ``grad_output``. autograd.grad with an explicit input computes that
        gradient only: parameter .grad stays untouched."""
        leaf = hidden.detach().to(self.device).requires_grad_(True)
        with torch.enable_grad(), self._ctx(bf16):
            out = module._compute(leaf, leaf, targets)
            if grad_output is None:
                (grad,) = torch.autograd.grad(out * (1.0 / self.run.batch.microbatches_per_step), [leaf])
            else:
                (grad,) = torch.autograd.grad(out, [leaf], grad_outputs=grad_output.to(self.device))
        return grad

    # -- averaging and the step ------------------------------------------------------------------
    def held_tickets(self, step: int) -> list[int]:
        """Tickets of ``step`` whose parameter gradients this replica holds, sorted."""
        return sorted(t for s, t in self._ticket_grads if s == step)

    @torch.no_grad()
    def flat_grads(self, step: int, tickets: list[int]) -> torch.Tensor:
        """The sum of exactly ``tickets`` of ``step``, flat float32 on the CPU, in ticket order.

        Raises KeyError naming the tickets this replica does not hold.
        """
        missing = [t for t in tickets if (step, t) not in self._ticket_grads]
        if missing:
            raise KeyError(f"stage {self.stage} holds no gradients for tickets {missing} of step {step}")
        total = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        for t in sorted(tickets):
            for acc, g in zip(total, self._ticket_grads[(step, t)]):
                if g is not None:
                    acc.add_(g.float())
        parts = [acc.reshape(-1).cpu() for acc in total]
        return torch.cat(parts) if parts else torch.zeros(0)

    def forget(self, step: int) -> None:
        """Drop the gradients and graphs of steps up to ``step`` (it was applied or abandoned)."""
        for key in [k for k in self._ticket_grads if k[0] <= step]:
            del self._ticket_grads[key]
        for key in [k for k in self._keys if isinstance(k, tuple) and k[0] <= step]:
            self.module.discard(key)
            self._keys.discard(key)

    @torch.no_grad()
    def apply(self, step: int, flat: torch.Tensor) -> tuple[str, float]:
        """Install the averaged gradients, take optimizer step ``step``; returns (:meth:`step_hash`, grad norm).

        Which step comes next is the node core's to know (:attr:`NodeCore.applied`), not the worker's.
        """
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(self.device, dtype=p.dtype).clone()
            offset += n
        norm = apply_step(self.module, self.optimizer, step, self.run.optim)
        self.applied = step + 1
        return self.step_hash(), norm

    # -- DiLoCo ----------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_inner(self, step: int, tickets: list[int]) -> tuple[str, float]:
        """DiLoCo's inner step ``step``: this replica's own AdamW step on the mean gradient of exactly ``tickets``
        (each ticket's gradient is scaled by 1/B, so their sum is rescaled by B/len); with no ticket, no update.
        Returns (param hash, grad norm)."""
        if not tickets:
            self.applied = step + 1
            return self.step_hash(), 0.0
        flat = self.flat_grads(step, tickets) * (self.run.batch.microbatches_per_step / len(tickets))
        return self.apply(step, flat)

    def pseudo_gradient(self) -> torch.Tensor:
        """DiLoCo: the anchor minus the parameters now, flat float32 ``(N,)`` (``stages/outer.py``)."""
        return pseudo_gradient(self._outer().anchor, self.params)

    @torch.no_grad()
    def apply_outer(self, avg: torch.Tensor, applied: int) -> str:
        """DiLoCo's outer step on the averaged pseudo-gradient ``avg`` ``(N,)``: the new anchor becomes the
        parameters, after ``applied`` steps. The inner AdamW state stays this replica's. Returns the new hash."""
        o = self._outer()
        sync = self.run.sync
        o.anchor, o.momentum = nesterov_step(o.anchor, o.momentum, avg, lr=sync.outer_lr, mu=sync.outer_momentum)
        unflatten_into(o.anchor, self.params)
        o.anchor_hash = self._anchor_hash()
        o.anchor_applied = o.since_step = applied
        self.applied = applied
        return o.anchor_hash

    def with_anchor(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with the anchor installed as the parameters, then put the parameters back bit for bit."""
        now = flatten(self.params)
        unflatten_into(self._outer().anchor, self.params)
        try:
            return fn()
        finally:
            unflatten_into(now, self.params)

    def outer_momentum(self) -> dict[str, torch.Tensor] | None:
        """DiLoCo: the outer momentum by parameter name (what a checkpoint stores); None otherwise."""
        if self.outer is None:
            return None
        out, offset = {}, 0
        for n, p in zip(self.names, self.params):
            out[n] = self.outer.momentum[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out

    def take_anchor(self, momentum: dict[str, torch.Tensor] | None = None) -> None:
        """DiLoCo: the parameters just installed (a donor's anchor, a checkpoint's, or the init) are the
        anchor, with ``momentum`` by parameter name (None: zeros). Its step is unknown until :meth:`anchored`."""
        o = self._outer()
        o.anchor = flatten(self.params)
        o.momentum = flatten([momentum[n] for n in self.names]) if momentum else torch.zeros_like(o.anchor)
        o.anchor_hash = self._anchor_hash()
        o.anchor_applied = o.since_step = -1

    def anchored(self, applied: int, since_step: int) -> None:
        """DiLoCo: the anchor is the stage's state after ``applied`` steps, and this replica trains on from
        ``since_step`` (its inner steps cover the steps from there to the next sync)."""
        o = self._outer()
        o.anchor_applied, o.since_step = applied, since_step

    def _outer(self) -> OuterState:
        if self.outer is None:
            raise RuntimeError("this run averages every step; it has no outer state")
        return self.outer

    def zero_grads(self) -> None:
        """Drop accumulated gradients and in-flight graphs (before installing another replica's state)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._ticket_grads.clear()
        for key in list(self._keys):
            self.module.discard(key)
        self._keys.clear()

    def state_hash(self) -> str:
        """The hash of the state this replica shares with its stage's other replicas
        (:func:`~protolearn.node.checkpoint.shared_state_hash`): the parameters and AdamW's state, or in DiLoCo
        mode the anchor and the outer momentum."""
        if self.outer is not None:
            return self.outer.anchor_hash
        return shared_state_hash(self.module, self.optimizer)

    def step_hash(self) -> str:
        """What this replica reports after a step: :meth:`state_hash`, or in DiLoCo mode the hash of its own
        parameters (its inner steps are its own; the anchor's hash is reported after each outer sync)."""
        return self.state_hash() if self.outer is None else self.module.state_hash()

    def _anchor_hash(self) -> str:
        """DiLoCo: the shared state's hash, with the anchor installed as the parameters (the caller's to ensure)."""
        return shared_state_hash(self.module, self.optimizer, outer_momentum=self.outer_momentum())

    # -- state sync ------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and optimizer state as (name, CPU tensor) pairs, copies safe to send later. In DiLoCo
        mode the parameters are the anchor (the stage's shared state), with the outer momentum."""
        if self.outer is not None:
            out = self.with_anchor(lambda: [(f"param/{n}", p.detach().cpu().clone()) for n, p in zip(self.names, self.params)])
            out += [(f"{OUTER_KEY}/{n}", m.clone()) for n, m in (self.outer_momentum() or {}).items()]
        else:
            out = [(f"param/{n}", p.detach().cpu().clone()) for n, p in zip(self.names, self.params)]
        for n, p in zip(self.names, self.params):
            st = self.optimizer.state.get(p, {})
            for k in OPTIM_KEYS:
                if k in st:
                    out.append((f"{k}/{n}", st[k].detach().cpu().clone()))
        return out

    def shared_snapshot(self, applied: Callable[[], int], self_test: bool) -> Snapshot:
        """What this replica serves a joiner (:data:`~protolearn.node.checkpoint.Snapshot`): the steps its state is
        after, its hash, :meth:`snapshot`, the self-test output computed with it as raw float32 bytes (or b"") and
        the digests of the shared part of it (:func:`~protolearn.node.checkpoint.shared_leaves`), whose root is
        the hash. ``applied()``: this replica's applied steps, read here, with the parameters it goes with (the
        caller holds the compute lock); in DiLoCo mode the state is the anchor instead, after its own steps."""
        entries = self.snapshot()
        leaves = shared_leaves(entries, diloco=self.outer is not None)
        if self.outer is None:
            test = self.self_test().numpy().tobytes() if self_test else b""
            return Snapshot(applied(), state_root(leaves), entries, test, leaves)
        test = self.with_anchor(self.self_test).numpy().tobytes() if self_test else b""
        return Snapshot(self.outer.anchor_applied, state_root(leaves), entries, test, leaves)

    def expected(self, name: str) -> tuple[torch.dtype, list[int]] | None:
        """The dtype and shape a snapshot entry must have, or None if the name is not one of ours."""
        kind, _, pname = name.partition("/")
        if pname not in self._index:
            return None
        p = self.params[self._index[pname]]
        if kind == "step":
            return torch.float32, []
        if kind in ("param", "exp_avg", "exp_avg_sq"):
            return p.dtype, list(p.shape)
        if kind == OUTER_KEY and self.outer is not None:
            return torch.float32, list(p.shape)
        return None

    @property
    def _index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @torch.no_grad()
    def load(self, entries: dict[str, torch.Tensor]) -> str:
        """Install a donor's snapshot (already validated by name, dtype and shape); returns the new :meth:`state_hash`."""
        missing = [n for n in self.names if f"param/{n}" not in entries]
        if missing:
            raise ValueError(f"snapshot lacks parameters {missing[:3]}")
        index = self._index
        for n in self.names:
            self.params[index[n]].copy_(entries[f"param/{n}"].to(self.device))
        self.optimizer.state.clear()
        for n in self.names:
            p = self.params[index[n]]
            st = {k: entries[f"{k}/{n}"] for k in OPTIM_KEYS if f"{k}/{n}" in entries}
            if st:
                # AdamW keeps "step" on the CPU (not capturable); the moments live beside the parameter.
                self.optimizer.state[p] = {k: (v.clone() if k == "step" else v.to(self.device).clone()) for k, v in st.items()}
        if self.outer is not None:
            momentum = {n: entries[f"{OUTER_KEY}/{n}"] for n in self.names if f"{OUTER_KEY}/{n}" in entries}
            self.take_anchor(momentum if len(momentum) == len(self.names) else None)
        return self.state_hash()
