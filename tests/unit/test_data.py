"""Tokenizer, corpus split and deterministic sampling."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from protolearn.errors import ConfigError
from protolearn.stages import tokenizer
from protolearn.stages.config import DataConfig, default_run
from protolearn.stages import corpus as corpus_module
from protolearn.stages.corpus import load_corpus
from protolearn.stages.sampling import microbatch, validation_batches


def make_folder(root: Path, n: int = 30) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (20 + i))
    (root / "image.png").write_bytes(b"\x89PNG not text")  # ignored: not a text suffix
    return root


def test_byte_tokenizer_round_trip_and_specials() -> None:
    text = "héllo\n\tworld ✓"
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS
    assert all(0 <= i < tokenizer.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text
    assert default_run().model.vocab_size == tokenizer.VOCAB_SIZE


def test_folder_split_is_by_file_and_disjoint(tmp_path: Path) -> None:
    corpus = load_corpus(DataConfig(path=str(make_folder(tmp_path / "c")), val_fraction=0.2))
    assert corpus.train_files and corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert set(corpus.train_files) | set(corpus.val_files) == {f"doc{i:02d}.txt" for i in range(30)}
    # Every file is BOS ... EOS, so the token counts add up to the file sizes plus two per file.
    size = sum((tmp_path / "c" / f).stat().st_size + 2 for f in corpus.val_files)
    assert corpus.val.numel() == size


def test_stdlib_corpus_is_the_default_and_split_is_disjoint() -> None:
    corpus = load_corpus(DataConfig(max_bytes=300_000))
    assert "stdlib" in corpus.source
    assert corpus.train_files and corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert all(f.endswith(".py") and "site-packages" not in f for f in corpus.train_files)
    assert corpus.train.numel() + corpus.val.numel() <= 300_000 + 2 * (len(corpus.train_files) + len(corpus.val_files))


def test_small_folder_still_gets_both_splits(tmp_path: Path) -> None:
    corpus = load_corpus(DataConfig(path=str(make_folder(tmp_path / "c", n=2))))
    assert len(corpus.train_files) == len(corpus.val_files) == 1


@pytest.mark.parametrize(("setup", "expected"), [("missing", "does not exist"), ("empty", "0 non-empty"), ("one", "1 non-empty")])
def test_unusable_data_folder_is_a_one_line_config_error(setup: str, expected: str, tmp_path: Path) -> None:
    root = tmp_path / "d"
    if setup != "missing":
        root.mkdir()
    if setup == "one":
        (root / "a.txt").write_text("only one file")
    with pytest.raises(ConfigError, match=expected) as info:
        load_corpus(DataConfig(path=str(root)))
    assert "\n" not in str(info.value)


def test_unreadable_files_are_skipped_with_one_warning_that_counts_and_names_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = make_folder(tmp_path / "c", n=6)
    for i in range(7):  # broken links read as OSError even for root, unlike chmod 000
        (root / f"gone{i}.txt").symlink_to(tmp_path / "nowhere" / f"{i}.txt")
    caplog.set_level(logging.WARNING, logger="protolearn.stages")
    corpus = load_corpus(DataConfig(path=str(root), max_bytes=10_000_000))
    assert set(corpus.train_files) | set(corpus.val_files) == {f"doc{i:02d}.txt" for i in range(6)}
    warnings = [r.getMessage() for r in caplog.records if r.name == "protolearn.stages"]
    assert len(warnings) == 1, warnings
    assert "skipped 7 unreadable file(s)" in warnings[0] and "uses the 6 readable file(s)" in warnings[0]
    named = [f"gone{i}.txt" for i in range(7) if f"gone{i}.txt" in warnings[0]]
    assert len(named) == corpus_module.NUM_NAMED_SKIPS and ", ..." in warnings[0]  # a few names, not all seven


def test_a_folder_with_only_unreadable_files_is_a_one_line_error_that_says_so(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    for name in ("a.txt", "b.txt", "c.md"):
        (root / name).symlink_to(tmp_path / "nowhere" / name)
    with pytest.raises(ConfigError, match="0 non-empty") as info:
        load_corpus(DataConfig(path=str(root)))
    text = str(info.value)
    assert "3 unreadable file(s) or folder(s): a.txt, b.txt, c.md" in text and "permissions" in text
    assert "\n" not in text


def test_microbatch_is_a_pure_function_of_seed_step_index(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "c")
    run = default_run().replace(**{"data.path": str(folder), "batch.seq_len": 32})
    corpus = load_corpus(run.data)
    x, y = microbatch(run, corpus, 3, 1)
    assert x.shape == y.shape == (run.batch.microbatch_size, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(x, microbatch(run, corpus, 3, 1)[0])
    assert not torch.equal(x, microbatch(run, corpus, 3, 2)[0])
    assert not torch.equal(x, microbatch(run, corpus, 4, 1)[0])
    assert not torch.equal(x, microbatch(run.replace(seed=1), corpus, 3, 1)[0])

    # (Another process rebuilds identical tokens: tests/integration/test_across_processes.py.)


def test_validation_batches_are_fixed_and_from_validation_files(tmp_path: Path) -> None:
    run = default_run().replace(**{"data.path": str(make_folder(tmp_path / "c")), "batch.seq_len": 16})
    corpus = load_corpus(run.data)
    a, b = validation_batches(run, corpus, 3), validation_batches(run, corpus, 3)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    val_text = bytes(int(t) for t in corpus.val if t < 256)
    for x, _ in a:
        for row in x:
            window = bytes(int(t) for t in row if t < 256)
            assert window[:8] in val_text


def test_too_little_text_for_seq_len_is_a_config_error(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.txt").write_text("tiny")
    (root / "b.txt").write_text("tiny")
    run = default_run().replace(**{"data.path": str(root)})
    with pytest.raises(ConfigError, match="fewer than batch.seq_len"):
        microbatch(run, load_corpus(run.data), 0, 0)
