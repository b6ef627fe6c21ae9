"""Llama-style building blocks, the whole-model :class:`Transformer`, and deterministic per-parameter init.

Blocks: pre-norm RMSNorm, causal self-attention with rotary position embeddings (RoPE) through
``F.scaled_dot_product_attention``, and a SwiGLU MLP. The token embedding and the LM head are
untied, because they live on different pipeline stages.

Parameter names are global (``embed.weight``, ``blocks.3.attn.wq.weight``, ``head.out.weight``) in
the whole model and in every stage. :func:`init_parameters` seeds one ``torch.Generator`` per
parameter from (run seed, full parameter name) only, and the name carries the role and the layer
index. So a stage built alone equals the same stage cut from the whole model, bit for bit, whatever
the split.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protolearn.stages.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Precomputed RoPE tables; buffers, not parameters, so they are not trained, shipped or hashed."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (Tmax, hd/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: (mb, H, T, hd); rotate the two halves of each head (GPT-NeoX layout).
        t = x.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]  # (T, hd/2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        mb, t, d = x.shape
        h = self.n_heads
        q = self.wq(x).view(mb, t, h, d // h).transpose(1, 2)  # (mb, H, T, hd)
        k = self.wk(x).view(mb, t, h, d // h).transpose(1, 2)
        v = self.wv(x).view(mb, t, h, d // h).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (mb, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(mb, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # up
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)  # down, writes to the residual stream

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))  # (mb, T, D)
        return x + self.mlp(self.mlp_norm(x))


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight)  # (mb, T) -> (mb, T, D)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))  # (mb, T, D) -> (mb, T, V)


def make_blocks(cfg: ModelConfig, layers: range) -> nn.ModuleDict:
    """Blocks keyed by their global layer index, so parameter names match the whole model."""
    return nn.ModuleDict({str(i): Block(cfg) for i in layers})


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over all (mb, T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a function of the run seed and its global name only."""
    digest = hashlib.sha256(f"protolearn-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


_RESIDUAL_WRITERS = ("attn.wo.weight", "mlp.w2.weight")


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter of ``module`` (whole model or stage) from its own seeded generator.

    Norm gains start at 1. Other weights are N(0, init_std); the projections that write to the
    residual stream are scaled down by sqrt(2 n_layers) (GPT-2) so the stream's variance stays
    bounded with depth. Values are drawn on the CPU and copied, so every device gets the same bits.
    """
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = cfg.init_std
        if name.endswith(_RESIDUAL_WRITERS):
            std /= math.sqrt(2 * cfg.n_layers)
        g = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))


class Transformer(nn.Module):
    """The whole model in one module; used to check that the chained stages compute the same thing."""

    def __init__(self, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = make_blocks(cfg, range(cfg.n_layers))
        self.head = Head(cfg)
        init_parameters(self, cfg, seed)
        self.to(device)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (mb, T, D)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)  # (mb, T, V)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(self(tokens), targets)
