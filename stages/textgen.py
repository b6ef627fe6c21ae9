"""Sampling text from a trained model: a prompt in, a continuation out, one byte token at a time.

:func:`sample` runs the whole model (:class:`~protolearn.stages.model.Transformer`, every stage in
one module) on the prompt's byte tokens and draws each next token from the softmax of the last
position's logits divided by ``temperature`` (0: always the most likely token), among the ``top_k``
most likely (0: all of them). The context is the last ``max_seq_len`` tokens (the model's RoPE tables
end there), and each step recomputes it: no cache, which is plenty for the models a swarm of CPUs and
consumer GPUs trains. Every draw comes from the one seeded ``torch.Generator``, so a seed repeats a
sample exactly. Sampling stops after ``max_new_tokens`` or at the end-of-document token.
"""

from __future__ import annotations

import torch
from torch import nn

from protolearn.stages.tokenizer import BOS, EOS


@torch.no_grad()
def sample(
    model: nn.Module, prompt: list[int], *, max_new_tokens: int, max_seq_len: int, temperature: float = 0.8, top_k: int = 50,
    seed: int = 0, stop_at_eos: bool = True,
) -> list[int]:
    """The tokens ``model`` continues ``prompt`` with (see the module docstring); ``prompt`` may be empty."""
    if temperature < 0:
        raise ValueError(f"temperature {temperature} must be >= 0")
    if max_new_tokens < 0 or max_seq_len < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} and max_seq_len {max_seq_len} must be >= 0 and >= 1")
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = [BOS, *prompt]  # every training document starts with BOS
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-max_seq_len:]], dtype=torch.int64, device=device)  # (1, T)
        logits = model(context)[0, -1].float().cpu()  # (V,)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g))
        if stop_at_eos and nxt == EOS:
            break
        tokens.append(nxt)
        out.append(nxt)
    return out

