"""The codec spec grammar: the one parser of strings like ``int8`` or ``topk:0.05``.

A codec spec names an activation/gradient codec and its parameter::

    spec     = "none" | "fp16" | "bf16" | "int8" | topk
    topk     = "topk" [ ":" fraction ]          fraction: a float in (0, 1], default 0.05

It is spelled in two places, the run config's ``codec`` field (``protolearn.stages.config``) and every
tensor frame's ``codec`` field on the wire (``protolearn.protocol.codecs``), and both go through
:func:`parse_codec_spec` here, so a spec the config accepts is exactly one the codecs can run.

Why this module sits in the root package: the design card lets ``stages`` import only torch and
pydantic, and ``protocol`` neither ``stages`` nor the other way round, so neither package may hold
a grammar the other one needs. The root package (next to :mod:`protolearn.errors`, which both already
import) is the one place both can reach without a new edge between them. The module is pure: no
torch, no trio, no libp2p.

Every refusal is a one-line :class:`CodecSpecError` that names the field it came from
(``codec='zip' is unknown; …``). It is a :class:`ValueError` too, so a pydantic validator that lets it
through reports it as that field's value error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protolearn.errors import ConfigError

CODECS = ("none", "fp16", "bf16", "int8", "topk")
DEFAULT_TOPK_FRACTION = 0.05
# Specs travel in every tensor frame; a longer one is refused before it is parsed.
MAX_SPEC_CHARS = 32
_ALLOWED = f"use one of {', '.join(CODECS)} (or topk:F with 0 < F <= 1, e.g. topk:0.05)"


class CodecSpecError(ConfigError, ValueError):
    """A codec spec is not one of the known forms (a ValueError too, so pydantic validators accept it)."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec. ``str(spec)`` is its canonical wire name (``topk`` reads ``topk:0.05``)."""

    name: str
    fraction: float | None = None

    def __str__(self) -> str:
        return f"{self.name}:{self.fraction!r}" if self.fraction is not None else self.name


def parse_codec_spec(spec: object, *, field: str = "codec") -> CodecSpec:
    """Parse ``none | fp16 | bf16 | int8 | topk | topk:<fraction in (0, 1]>``.

    ``field`` names where the spec came from in the error (``codec``, ``frame codec``, …).
    """
    if not isinstance(spec, str):
        raise CodecSpecError(f"{field} must be a string, got {type(spec).__name__}; {_ALLOWED}")
    if len(spec) > MAX_SPEC_CHARS:
        raise CodecSpecError(f"{field}={spec[:MAX_SPEC_CHARS]!r}... is longer than {MAX_SPEC_CHARS} characters; {_ALLOWED}")
    name, sep, arg = spec.partition(":")
    if name not in CODECS or (sep and name != "topk"):
        raise CodecSpecError(f"{field}={spec!r} is unknown; {_ALLOWED}")
    if name != "topk":
        return CodecSpec(name)
    if not sep:
        return CodecSpec(name, DEFAULT_TOPK_FRACTION)
    try:
        fraction = float(arg)
    except ValueError:
        fraction = math.nan
    if not 0.0 < fraction <= 1.0:  # also refuses NaN
        raise CodecSpecError(f"{field}={spec!r}: the topk fraction must be a number in (0, 1], e.g. topk:0.05")
    return CodecSpec(name, fraction)
