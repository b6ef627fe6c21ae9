"""A Hugging Face copy of an exported model: ``model.safetensors`` and ``config.json`` that ``transformers``
loads as a ``LlamaForCausalLM``.

protolearn's model is a Llama (pre-norm RMSNorm, rotary embeddings, SwiGLU, no biases), so the copy is
a renaming of the same tensors (:data:`NAMES`), with no arithmetic:

- the rotary embedding rotates the two halves of each head (the GPT-NeoX layout), which is what
  ``transformers``' ``rotate_half`` does, so the query and key projections need no permutation;
- the token embedding and the output layer are separate tensors (``tie_word_embeddings: false``);
- every attention head has its own keys and values (``num_key_value_heads`` = ``num_attention_heads``).

The vocabulary is the byte tokenizer's (:mod:`protolearn.stages.tokenizer`): ids 0-255 are the bytes
of UTF-8 text, 256 BOS, 257 EOS, 258 PAD, so there is no tokenizer file to ship; ``README.md`` beside
the weights says how to encode text. ``tests/unit/test_hf_export.py`` loads the copy with
``transformers`` and checks that its logits equal the model's own within 1e-5.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save as st_save
from torch import Tensor

from protolearn.node.checkpoint import CheckpointError, write_atomic
from protolearn.stages.config import RunConfig
from protolearn.stages.tokenizer import BOS, EOS, PAD

# protolearn name pattern → Hugging Face Llama name ({i}: the layer).
NAMES: tuple[tuple[str, str], ...] = (
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"blocks\.(\d+)\.attn_norm\.weight", "model.layers.{i}.input_layernorm.weight"),
    (r"blocks\.(\d+)\.attn\.wq\.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    (r"blocks\.(\d+)\.attn\.wk\.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    (r"blocks\.(\d+)\.attn\.wv\.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    (r"blocks\.(\d+)\.attn\.wo\.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    (r"blocks\.(\d+)\.mlp_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blocks\.(\d+)\.mlp\.w1\.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.w3\.weight", "model.layers.{i}.mlp.up_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.w2\.weight", "model.layers.{i}.mlp.down_proj.weight"),
    (r"head\.norm\.weight", "model.norm.weight"),
    (r"head\.out\.weight", "lm_head.weight"),
)
_COMPILED = [(re.compile(f"^{p}$"), hf) for p, hf in NAMES]

CARD = """# {name}, trained with protolearn

A Llama-style causal language model ({params:,} parameters, step {step}), loadable with
`transformers.LlamaForCausalLM.from_pretrained(this folder)`.

Tokens are bytes: encode text as its UTF-8 bytes (ids 0-255), start a document with {bos} (BOS);
{eos} ends one (EOS), {pad} is padding. For example:

    ids = [{bos}] + list("def ".encode("utf-8"))
    text = bytes(i for i in generated_ids if i < 256).decode("utf-8", errors="replace")
"""


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of a protolearn parameter name (ValueError for one it has no place for)."""
    for pattern, hf in _COMPILED:
        m = pattern.match(name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart")


def hf_config(run: RunConfig) -> dict[str, object]:
    m = run.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": m.init_std,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def write_hf(params: Mapping[str, Tensor], run: RunConfig, step: int, out_dir: str | Path) -> Path:
    """Write ``params`` (the whole model, protolearn names) as a Hugging Face Llama folder; returns it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(str(out), "is a file; a Hugging Face export is a folder (config.json, model.safetensors)")
    try:
        tensors = {hf_name(n): t.detach().to("cpu", copy=True).contiguous() for n, t in sorted(params.items())}
    except ValueError as err:
        raise CheckpointError(str(out), f"cannot be written as a Llama: {err}") from None
    write_atomic(out / "model.safetensors", st_save(tensors, metadata={"format": "pt"}))
    write_atomic(out / "config.json", (json.dumps(hf_config(run), indent=2) + "\n").encode())
    generation = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    write_atomic(out / "generation_config.json", (json.dumps(generation, indent=2) + "\n").encode())
    card = CARD.format(name=run.name, params=sum(t.numel() for t in tensors.values()), step=step, bos=BOS, eos=EOS, pad=PAD)
    write_atomic(out / "README.md", card.encode())
    return out
