"""The training text: a folder of text files, or by default the running Python's stdlib ``.py`` files.

Files are split into train and validation BY FILE, from a hash of each file's relative path, so the
split is the same in every process and no text is in both. Each file becomes ``BOS bytes EOS`` and
a split is the concatenation of its files (int16, compact). Reading stops at ``max_bytes``; files are
taken in hash order rather than name order, so a capped corpus still samples the whole tree. The
result is cached per :class:`DataConfig` in this process.

Files and folders that cannot be read (permissions, a broken link) are skipped, never silently: one
warning gives their count and the first few names. Fewer than two readable non-empty files is a
one-line :class:`~protolearn.errors.ConfigError` that names the unreadable ones too.

Note: the stdlib differs between Python versions. :attr:`Corpus.fingerprint` lets nodes check
that they hold the same tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protolearn.errors import ConfigError
from protolearn.stages.config import DataConfig
from protolearn.stages.tokenizer import encode_document

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".toml", ".json", ".csv", ".html", ".c", ".h", ".js", ".ts")
# Third-party and generated code is not part of the default corpus.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib2to3"}
# How many unreadable files a warning or an error names; the count covers them all.
NUM_NAMED_SKIPS = 5

log = logging.getLogger("protolearn.stages")


@dataclass(frozen=True)
class Corpus:
    """Token ids of the train and validation splits, and which files went where."""

    train: torch.Tensor  # (N_train,) int16
    val: torch.Tensor  # (N_val,) int16
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    source: str
    fingerprint: str  # sha256 over both splits' tokens


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "little")


def _is_val(rel: str, val_fraction: float) -> bool:
    return _path_hash("val/" + rel) / 2**64 < val_fraction


def _list_files(root: Path, *, stdlib: bool) -> tuple[list[str], list[str]]:
    """The text files under ``root`` (relative paths), and the folders that could not be listed
    (relative, with a trailing ``/``): os.walk skips those silently unless asked."""
    found: list[str] = []
    unlisted: list[str] = []

    def on_error(err: OSError) -> None:
        where = Path(err.filename) if err.filename else root
        rel = where.relative_to(root).as_posix() if where.is_relative_to(root) else str(where)
        unlisted.append(("" if rel == "." else rel) + "/")

    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error):
        if stdlib:
            dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        else:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            if fn.startswith("."):
                continue
            if (stdlib and fn.endswith(".py")) or (not stdlib and fn.lower().endswith(TEXT_SUFFIXES)):
                found.append(Path(dirpath, fn).relative_to(root).as_posix())
    return sorted(found), sorted(unlisted)


def _read(root: Path, files: list[str], max_bytes: int) -> tuple[list[tuple[str, bytes]], list[str]]:
    """The (relative path, bytes) of the files read, in hash order up to ``max_bytes``, and the
    relative paths of the files that could not be read (permissions, a broken link, a vanished file)."""
    docs: list[tuple[str, bytes]] = []
    unreadable: list[str] = []
    total = 0
    for rel in sorted(files, key=_path_hash):
        if total >= max_bytes:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError:
            unreadable.append(rel)  # reported by the caller: the corpus must never shrink unseen
            continue
        if not data:
            continue
        data = data[: max_bytes - total]
        docs.append((rel, data))
        total += len(data)
    return docs, unreadable


def _describe(unreadable: list[str]) -> str:
    """``3 unreadable file(s) or folder(s): a.txt, b/, c/d.md`` (at most NUM_NAMED_SKIPS names)."""
    names = ", ".join(unreadable[:NUM_NAMED_SKIPS]) + (", ..." if len(unreadable) > NUM_NAMED_SKIPS else "")
    return f"{len(unreadable)} unreadable file(s) or folder(s): {names}"


def _concat(docs: list[tuple[str, bytes]]) -> torch.Tensor:
    if not docs:
        return torch.zeros(0, dtype=torch.int16)
    return torch.from_numpy(np.concatenate([encode_document(d) for _, d in docs]))


_CACHE: dict[str, Corpus] = {}


def load_corpus(data: DataConfig) -> Corpus:
    """Load (or return the cached) corpus of ``data``; a missing or empty folder is a ConfigError."""
    key = data.model_dump_json()
    if key not in _CACHE:
        _CACHE[key] = _load(data)
    return _CACHE[key]


def _load(data: DataConfig) -> Corpus:
    if data.path is None:
        root, stdlib = Path(sysconfig.get_paths()["stdlib"]), True
        source = f"python stdlib at {root}"
    else:
        root, stdlib = Path(data.path).expanduser(), False
        source = str(root)
        if not root.is_dir():
            raise ConfigError(f"data folder '{root}' does not exist or is not a folder; pass --data FOLDER of text files")
    files, unlisted = _list_files(root, stdlib=stdlib)
    docs, unread = _read(root, files, data.max_bytes)
    unreadable = sorted(unlisted + unread)
    if len(docs) < 2:
        skipped = f", and {_describe(unreadable)} (check their permissions)" if unreadable else ""
        raise ConfigError(
            f"data folder '{root}' has {len(docs)} non-empty text file(s) ({', '.join(TEXT_SUFFIXES)}){skipped}; "
            "it needs at least 2, because train and validation are split by file"
        )
    if unreadable:
        log.warning("corpus %s: skipped %s; training uses the %d readable file(s)", source, _describe(unreadable), len(docs))
    val_docs = [d for d in docs if _is_val(d[0], data.val_fraction)]
    train_docs = [d for d in docs if not _is_val(d[0], data.val_fraction)]
    # A small folder can hash all files to one side; move the most extreme file over, deterministically.
    if not val_docs:
        pick = min(train_docs, key=lambda d: _path_hash("val/" + d[0]))
        train_docs.remove(pick)
        val_docs = [pick]
    elif not train_docs:
        pick = max(val_docs, key=lambda d: _path_hash("val/" + d[0]))
        val_docs.remove(pick)
        train_docs = [pick]
    train, val = _concat(train_docs), _concat(val_docs)
    h = hashlib.sha256()
    h.update(train.numpy().tobytes())
    h.update(b"|")
    h.update(val.numpy().tobytes())
    return Corpus(
        train=train,
        val=val,
        train_files=tuple(sorted(r for r, _ in train_docs)),
        val_files=tuple(sorted(r for r, _ in val_docs)),
        source=source,
        fingerprint=h.hexdigest(),
    )
