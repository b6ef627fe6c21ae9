"""One pipeline stage as a module that keeps autograd state per microbatch in flight.

A node runs several microbatches through its stage at once, and their backward passes come back in
any order. :meth:`StageModule.forward` therefore stores, per microbatch id, the detached input leaf
and the output of its graph; :meth:`StageModule.backward` backprops that one graph, accumulates into
the parameters' ``.grad``, returns the gradient for the previous stage and frees the state.

Stage 0 takes token ids ``(mb, T)`` int64 and returns hidden ``(mb, T, D)`` float32; a middle stage
maps hidden to hidden; the last stage takes hidden and targets and returns the mean cross-entropy
loss. A single stage that holds the whole model takes tokens and targets. Inputs may come from the
network, so they are checked (dtype, shape, token range) before any compute.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protolearn.stages.config import RunConfig
from protolearn.stages.errors import MicrobatchStateError, StageInputError
from protolearn.stages.model import Embed, Head, init_parameters, lm_loss, make_blocks
from protolearn.stages.partition import PartitionPlan
from protolearn.subspace import Subspace, make_subspace

# The name under which a parameter is hashed and sent (beside its optimizer state, e.g. ``exp_avg/<name>``).
PARAM_PREFIX = "param/"


class _ProjectGrad(torch.autograd.Function):
    """Identity forward; backward projects the gradient onto span(U): g -> (g U) Uᵀ.

    A subspace stage's input depends on the previous stage only through its coordinates in U (the
    rest is the fixed embedding of the tokens), so this is the exact gradient of the constrained
    model, and it is what the ``subspace`` codec can send back without loss.
    """

    @staticmethod
    def forward(ctx, x: Tensor, basis: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(basis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (basis,) = ctx.saved_tensors
        return (grad @ basis) @ basis.T, None


@dataclass
class _InFlight:
    input_leaf: Tensor | None  # requires grad; None on stage 0 (token ids have no gradient)
    output: Tensor  # hidden (mb, T, D), or the scalar loss on the last stage
    # The parameters' in-place version counters at the forward: an optimizer step (or an installed state)
    # since then makes the held graph stale, and its backward would compute wrong gradients.
    versions: tuple[int, ...] = ()


class StageModule(nn.Module):
    """The layers of one stage plus, on the ends, the embedding and the head. Build it with :func:`build_stage`."""

    def __init__(self, run: RunConfig, stage: int, device: str | torch.device = "cpu") -> None:
        super().__init__()
        plan = PartitionPlan.from_config(run)
        self.run_config = run
        self.plan = plan
        self.stage = stage
        self.first = plan.is_first(stage)
        self.last = plan.is_last(stage)
        self.layers = plan.layer_range(stage)
        cfg = run.model
        self.embed = Embed(cfg) if self.first else None
        self.blocks = make_blocks(cfg, self.layers)
        self.head = Head(cfg) if self.last else None
        init_parameters(self, cfg, run.seed)
        self.subspace: Subspace | None = None
        if run.subspace_key is not None:
            self.subspace = make_subspace(*run.subspace_key)
            # Not persistent: derived from the seed, so neither checkpoints nor state hashes carry them.
            self.register_buffer("subspace_basis", self.subspace.basis.clone(), persistent=False)
            if self.first:
                self.register_buffer("subspace_fixed", self.subspace.fixed_embedding.clone(), persistent=False)
            self.constrain_()
        self.to(device)
        self.device = torch.device(device)
        self._in_flight: dict[Hashable, _InFlight] = {}

    # -- the subspace constraint -----------------------------------------------------------------

    def _residual_writers(self) -> list[Tensor]:
        """The weights of this stage that write to the residual stream and are kept in span(U)."""
        constrained = self.run_config.model.n_layers - self.run_config.subspace.tail_blocks
        out = []
        for name, block in self.blocks.items():
            if int(name) < constrained:
                out += [block.attn.wo.weight, block.mlp.w2.weight]  # (D, D), (D, d_ff): columns in span(U)
        return out

    @torch.no_grad()
    def constrain_(self) -> None:
        """Project the residual writers onto span(U): W <- U Uᵀ W; the embedding onto E_fixed + span(U).

        A no-op for a run without a subspace.
        """
        if self.subspace is None:
            return
        u = self.subspace_basis  # (D, k)
        for w in self._residual_writers():
            w.copy_(u @ (u.T @ w))
        if self.embed is not None:
            fixed = self.subspace_fixed  # (V, D)
            e = self.embed.weight
            e.copy_(fixed + ((e - fixed) @ u) @ u.T)

    def after_step(self, step: int) -> None:
        """Called once optimizer step ``step`` (0-based) is applied: project every ``period``-th step."""
        if self.subspace is not None and (step + 1) % self.run_config.subspace.period == 0:
            self.constrain_()

    # -- input checks ----------------------------------------------------------------------------

    def _check_tokens(self, what: str, t: Tensor) -> None:
        cfg = self.run_config.model
        if t.dtype != torch.int64 or t.dim() != 2:
            raise StageInputError(f"stage {self.stage}: {what} must be int64 (mb, T), got {t.dtype} {tuple(t.shape)}")
        if not 1 <= t.shape[1] <= cfg.max_seq_len or t.shape[0] < 1:
            raise StageInputError(
                f"stage {self.stage}: {what} shape {tuple(t.shape)} needs mb >= 1 and 1 <= T <= {cfg.max_seq_len}"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.vocab_size):
            raise StageInputError(f"stage {self.stage}: {what} has ids outside 0..{cfg.vocab_size - 1}")

    def _check_hidden(self, what: str, h: Tensor, shape: tuple[int, ...] | None = None) -> None:
        d = self.run_config.model.d_model
        ok = h.dtype == torch.float32 and h.dim() == 3 and h.shape[-1] == d
        ok = ok and 1 <= h.shape[1] <= self.run_config.model.max_seq_len and h.shape[0] >= 1
        if shape is not None:
            ok = ok and tuple(h.shape) == shape
        if not ok:
            want = f"{shape}" if shape is not None else f"(mb, T<={self.run_config.model.max_seq_len}, {d})"
            raise StageInputError(f"stage {self.stage}: {what} must be float32 {want}, got {h.dtype} {tuple(h.shape)}")

    def _prepare(self, inputs: Tensor, targets: Tensor | None) -> Tensor | None:
        """Check inputs/targets and return the input leaf that will receive a gradient (None on stage 0)."""
        if self.first:
            self._check_tokens("input tokens", inputs)
            leaf = None
        else:
            self._check_hidden("input hidden", inputs)
            leaf = inputs.detach().to(self.device).requires_grad_(True)
        if self.last:
            if targets is None:
                raise StageInputError(f"stage {self.stage} is the last stage and needs targets")
            self._check_tokens("targets", targets)
            if tuple(targets.shape) != tuple(inputs.shape[:2]):
                raise StageInputError(
                    f"stage {self.stage}: targets shape {tuple(targets.shape)} != input shape {tuple(inputs.shape[:2])}"
                )
        return leaf

    # -- compute ---------------------------------------------------------------------------------

    def _body(self, inputs: Tensor, leaf: Tensor | None) -> Tensor:
        x = self.embed(inputs.to(self.device)) if self.embed is not None else leaf  # (mb, T, D)
        if self.subspace is not None and self.embed is None and x.requires_grad:
            x = _ProjectGrad.apply(x, self.subspace_basis)
        for block in self.blocks.values():
            x = block(x)
        return x

    def _compute(self, inputs: Tensor, leaf: Tensor | None, targets: Tensor | None) -> Tensor:
        x = self._body(inputs, leaf)
        if self.head is not None:
            return lm_loss(self.head(x), targets.to(self.device))  # scalar
        return x

    @torch.no_grad()
    def logits(self, inputs: Tensor) -> Tensor:
        """Last stage only: next-token logits ``(mb, T, V)`` without state (sampling, checks)."""
        if self.head is None:
            raise StageInputError(f"stage {self.stage} is not the last stage and has no LM head")
        if self.first:
            self._check_tokens("input tokens", inputs)
        else:
            self._check_hidden("input hidden", inputs)
        return self.head(self._body(inputs, None if self.first else inputs.to(self.device)))

    def forward(self, mb_id: Hashable, inputs: Tensor, targets: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """Run microbatch ``mb_id`` forward and keep its graph for :meth:`backward`.

        Returns the output detached: hidden ``(mb, T, D)``, or the scalar loss on the last stage.
        """
        if mb_id in self._in_flight:
            raise MicrobatchStateError(f"stage {self.stage}: microbatch {mb_id!r} is already in flight")
        leaf = self._prepare(inputs, targets)
        with torch.enable_grad():
            out = self._compute(inputs, leaf, targets)
        self._in_flight[mb_id] = _InFlight(leaf, out, self._versions())
        return out.detach()

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.parameters())

    @torch.no_grad()
    def infer(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        """Forward without keeping state (evaluation, spot checks): hidden, or the loss on the last stage."""
        self._prepare(inputs, targets)
        leaf = None if self.first else inputs.to(self.device)
        return self._compute(inputs, leaf, targets)

    def backward(self, mb_id: Hashable, grad_output: Tensor | None, *, loss_scale: float = 1.0) -> Tensor | None:
        """Backprop microbatch ``mb_id``, accumulate parameter grads, free its state.

        The last stage ignores ``grad_output`` (pass None) and backprops ``loss * loss_scale``; other
        stages need ``grad_output`` shaped like their output. Returns the gradient wrt the input
        hidden, or None on stage 0.
        """
        state = self._in_flight.get(mb_id)
        if state is None:
            raise MicrobatchStateError(f"stage {self.stage}: no microbatch {mb_id!r} in flight")
        if state.versions != self._versions():
            del self._in_flight[mb_id]
            raise MicrobatchStateError(f"stage {self.stage}: microbatch {mb_id!r} was forwarded before the parameters changed; its graph is stale")
        if self.last:
            if grad_output is not None:
                raise StageInputError(f"stage {self.stage} is the last stage; pass grad_output=None")
            del self._in_flight[mb_id]
            (state.output * loss_scale).backward()
        else:
            if grad_output is None:
                raise StageInputError(f"stage {self.stage}: backward needs grad_output")
            self._check_hidden("grad_output", grad_output, tuple(state.output.shape))
            del self._in_flight[mb_id]
            state.output.backward(grad_output.to(self.device))
        if state.input_leaf is None:
            return None
        return state.input_leaf.grad

    def discard(self, mb_id: Hashable) -> bool:
        """Drop the state of a microbatch whose route broke; True if it was in flight."""
        return self._in_flight.pop(mb_id, None) is not None

    def in_flight(self) -> int:
        return len(self._in_flight)

    def param_names(self) -> list[str]:
        """Global parameter names, sorted."""
        return sorted(name for name, _ in self.named_parameters())

    @torch.no_grad()
    def state_hash(self) -> str:
        """The hash of the parameters (:func:`state_root` of their :data:`PARAM_PREFIX`-named digests, in name
        order): the state of a stage with no optimizer state yet; bit-exact."""
        params = dict(self.named_parameters())
        return state_root(state_leaves([(f"{PARAM_PREFIX}{n}", params[n]) for n in sorted(params)]))


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """sha256 over ``name``, the dtype, the shape and the raw bytes of one tensor: a leaf of :func:`state_root`."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_leaves(entries: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """(name, :func:`tensor_digest`) of each (name, tensor), in the order given."""
    return [(name, tensor_digest(name, t)) for name, t in entries]


def state_root(leaves: Iterable[tuple[str, str]]) -> str:
    """The hash of a state from its tensors' (name, digest) leaves, in order. Being a hash of hashes, it lets a
    joiner check the digests a donor claims against the hash the stage's replicas report before it downloads
    a byte, and then each tensor as it arrives (node/state_sync.py)."""
    h = hashlib.sha256()
    for name, digest in leaves:
        h.update(f"{name}|{digest}\n".encode())
    return h.hexdigest()


def build_stage(run: RunConfig, stage: int, device: str | torch.device = "cpu") -> StageModule:
    """The deterministic initial module of ``stage`` of ``run``."""
    return StageModule(run, stage, device)
