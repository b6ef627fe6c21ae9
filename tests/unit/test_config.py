"""Run configs: the demo run, exact TOML round trips, a stable hash, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protolearn.codec_spec import CodecSpec, CodecSpecError
from protolearn.errors import ConfigError
from protolearn.protocol.codecs import make_encoder
from protolearn.stages.config import RunConfig, default_run, load_run_config


def test_demo_run_is_built_in_with_two_stages() -> None:
    run = load_run_config(None)
    assert run == default_run()
    assert run.name == "demo" and run.stages.num_stages == 2 and run.codec == "none"
    assert RunConfig.from_toml_text(run.to_toml()) == run


@settings(max_examples=40, deadline=None)
@given(
    name=st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
    seed=st.integers(0, 2**63 - 1),
    lr=st.floats(1e-6, 1.0),
    clip=st.one_of(st.none(), st.floats(1e-3, 100.0)),
    path=st.one_of(st.none(), st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s)),
    layers=st.one_of(st.none(), st.just([1, 3]), st.just([2, 2])),
)
def test_toml_round_trip_is_exact(
    name: str, seed: int, lr: float, clip: float | None, path: str | None, layers: list[int] | None
) -> None:
    run = default_run().replace(
        name=name, seed=seed, **{"optim.lr": lr, "optim.min_lr": lr / 10, "optim.clip_norm": clip,
                                  "data.path": path, "stages.layers": layers}
    )
    back = RunConfig.from_toml_text(run.to_toml())
    assert back == run
    assert back.run_hash() == run.run_hash()


BAD = [
    ('name = "x"\n[model]\nd_model = 250\n', "d_model=250 is not divisible by n_heads=8"),
    ('name = "x"\n[model\n', "TOML syntax error"),
    ('name = "x"\n[model\n', "line 2"),
    ("[model]\nfoo = 1\n", "unknown field 'model.foo'"),
    ("colour = 1\n", "unknown field 'colour'"),
    ("[stages]\nnum_stages = 9\n", "stages.num_stages=9 exceeds model.n_layers=4"),
    ("[stages]\nlayers = [1, 2, 1]\n", "stages.layers=[1, 2, 1] has 3 entries but stages.num_stages=2"),
    ("[stages]\nnum_stages = 2\nlayers = [1, 2]\n", "stages.layers=[1, 2] sums to 3 but model.n_layers=4"),
    ("[stages]\nlayers = [1, 2, 1]\nnum_stages = 3\n", None),
    ("[stages]\nlayers = [3, 2]\n", "sums to 5 but model.n_layers=4"),
    ("[stages]\nlayers = [4, 0]\n", "fewer than 1 layer"),
    ('[model]\nn_layers = "x"\n', "field 'model.n_layers' = 'x'"),
    ("[batch]\nseq_len = 1000\n", "batch.seq_len=1000 exceeds model.max_seq_len=256"),
    ('codec = "zip"\n', "codec='zip' is unknown"),
    ('codec = "topk:0.0500000000000000000000000000001"\n', "field 'codec': codec='topk:0.0500000000000000000000000'... is longer than 32"),
    ("[optim]\nwarmup_steps = 500\n", "warmup_steps=500 exceeds total_steps=200"),
    ("[optim]\nlr = nan\n", "field 'optim.lr' = nan"),
    ("[data]\nval_fraction = 1.5\n", "field 'data.val_fraction' = 1.5"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_bad_config_is_one_line_naming_field_and_value(text: str, expected: str | None, tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    if expected is None:  # a valid control case
        assert load_run_config(path).stages.layers == [1, 2, 1]
        return
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    msg = str(info.value)
    assert expected in msg
    assert "\n" not in msg and str(path) in msg


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_run_config(tmp_path)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "topk", "topk:0.05"])
def test_every_implemented_codec_is_accepted_and_round_trips(codec: str) -> None:
    run = default_run().replace(codec=codec)
    assert RunConfig.from_toml_text(run.to_toml()).codec == codec


@pytest.mark.parametrize("codec", ["subspace", "int8:3", "topk:0", "topk:2", "topk:x", "zstd"])
def test_unimplemented_or_malformed_codecs_are_refused_naming_the_field(codec: str) -> None:
    with pytest.raises(ConfigError, match="codec"):
        default_run().replace(codec=codec)


@pytest.mark.parametrize(
    "codec",
    ["none", "int8", "topk", "topk:0.25", "topk:1", "subspace", "subspace:int8", "subspace:zip", "subspace:topk:0.1",
     "int8:3", "topk:0", "topk:2", "topk:", "Int8", "topk:0.0500000000000000000000000000001"],
)
def test_config_and_codec_registry_accept_and_refuse_the_same_specs_with_the_same_words(codec: str) -> None:
    # One grammar: the run config validates exactly the specs a node can encode, and says the same thing.
    # (The run has a subspace, which the subspace codec needs; that is a check of its own, in test_subspace.py.)
    base = default_run().replace(**{"subspace.rank": 8})
    try:
        encoder_error = None
        spec = make_encoder(codec).spec
    except CodecSpecError as err:
        encoder_error = str(err)
    if encoder_error is None:
        run = base.replace(codec=codec)
        assert run.codec == codec and run.codec_spec == spec and isinstance(spec, CodecSpec)
        return
    with pytest.raises(ConfigError) as info:
        base.replace(codec=codec)
    line = str(info.value)
    assert "\n" not in line and line == f"run config override: field 'codec': {encoder_error}"
