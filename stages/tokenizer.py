"""The byte tokenizer: token ids 0..255 are raw bytes, then BOS (256), EOS (257) and PAD (258).

Byte-level tokens need no vocabulary file and no training, so every node rebuilds identical token
ids from identical text. ``VOCAB_SIZE`` (259) is what :class:`~protolearn.stages.config.ModelConfig`
defaults to. Training never emits PAD; the Hugging Face export names it as the padding id.
"""

from __future__ import annotations

import numpy as np

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 259


def encode(text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Token ids of ``text`` (UTF-8 bytes), optionally wrapped in BOS/EOS."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    ids = list(data)
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])


def encode_document(data: bytes) -> np.ndarray:
    """One document as ``BOS bytes... EOS`` in an int16 array (compact corpus storage)."""
    out = np.empty(len(data) + 2, dtype=np.int16)
    out[0] = BOS
    out[1:-1] = np.frombuffer(data, dtype=np.uint8)
    out[-1] = EOS
    return out


def decode(ids: list[int]) -> str:
    """Text of byte ids; specials are dropped and invalid UTF-8 is replaced."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
