"""The Hugging Face export loads back in ``transformers`` as a Llama with the same logits (within 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protolearn.node.export import load_transformer, write_model
from protolearn.node.hf_export import hf_name, write_hf
from protolearn.stages.config import default_run
from protolearn.stages.model import Transformer

transformers = pytest.importorskip("transformers", reason="the Hugging Face check needs the test extra: pip install -e '.[test]'")


def _trained_looking(run) -> Transformer:
    """The run's model with every weight perturbed (norm gains too), so no mapping error can hide behind an init of ones."""
    model = Transformer(run.model, run.seed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_the_hugging_face_export_loads_as_a_llama_with_the_same_logits(tmp_path: Path) -> None:
    run = default_run().replace(**{"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.d_ff": 96, "stages.num_stages": 2})
    model = _trained_looking(run)
    params = dict(model.named_parameters())
    exported = write_model(params, run, 7, tmp_path / "model.safetensors")
    back, info = load_transformer(exported.out)
    assert info.step == 7
    out = write_hf(params, run, 7, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "generation_config.json", "README.md"}

    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 2 and not hf.config.tie_word_embeddings
    tokens = torch.randint(0, run.model.vocab_size, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    assert theirs.shape == ours.shape
    err = float((theirs - ours).abs().max())
    print(f"max |logit difference| = {err:.3g}")
    assert err <= 1e-5
    with torch.no_grad():
        assert torch.equal(back(tokens), ours)  # the protolearn file round-trips exactly


def test_every_parameter_has_a_hugging_face_name_and_no_two_share_one() -> None:
    run = default_run()
    names = [n for n, _ in Transformer(run.model, run.seed).named_parameters()]
    mapped = [hf_name(n) for n in names]
    assert len(set(mapped)) == len(names)
    with pytest.raises(ValueError, match="no Hugging Face"):
        hf_name("blocks.0.attn.unknown")
