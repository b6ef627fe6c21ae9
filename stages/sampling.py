"""Deterministic microbatch sampling: the tokens of ticket (step, index) are a pure function of the seed.

A ticket's ``microbatch_size`` windows of ``seq_len + 1`` tokens start at offsets drawn by a
``torch.Generator`` seeded from sha256(run seed, split, step, index), so any process holding the
same corpus rebuilds identical tokens with no coordination. Targets are the inputs shifted by one.
"""

from __future__ import annotations

import hashlib

import torch

from protolearn.errors import ConfigError
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus


def ticket_seed(seed: int, split: str, step: int, index: int) -> int:
    digest = hashlib.sha256(f"protolearn-data/{seed}/{split}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _windows(tokens: torch.Tensor, seq_len: int, count: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = tokens.numel()
    if n < seq_len + 1:
        raise ConfigError(
            f"the {split} split has {n} tokens, fewer than batch.seq_len+1={seq_len + 1}; add text or lower seq_len"
        )
    g = torch.Generator(device="cpu").manual_seed(seed)
    starts = torch.randint(0, n - seq_len, (count,), generator=g)  # (mb,)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (mb, T+1)
    chunk = tokens[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (mb, T) each


def microbatch(run: RunConfig, corpus: Corpus, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training ``(inputs, targets)`` of ticket (step, index), each int64 ``(microbatch_size, seq_len)``."""
    b = run.batch
    return _windows(corpus.train, b.seq_len, b.microbatch_size, ticket_seed(run.seed, "train", step, index), "train")


def validation_batches(run: RunConfig, corpus: Corpus, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed validation microbatches (the same for every call and process)."""
    b = run.batch
    return [
        _windows(corpus.val, b.seq_len, b.microbatch_size, ticket_seed(run.seed, "val", 0, i), "validation")
        for i in range(n)
    ]
