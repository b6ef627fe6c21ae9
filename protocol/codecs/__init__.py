"""Activation and gradient codecs: how a float tensor is squeezed into a
:class:`~protolearn.protocol.tensors.TensorFrame`.

A codec spec names the codec and its parameter: ``none``, ``fp16``, ``bf16``, ``int8``, ``topk[:fraction]``
or ``subspace[:inner]``; its grammar and parser live in :mod:`protolearn.codec_spec`, shared with the run
config, and are re-exported here. :func:`make_encoder` builds a stateful encoder for one link (``topk``
keeps its error-feedback residual there); :func:`decode` is stateless and trusts nothing.

One module per codec holds both halves of its wire layout, its encoder and its decoder, and documents
it (``frame.dtype``/``frame.shape`` are those of the decoded tensor; C order; little endian):

============  ==================================  =====================================  ===========
codec         ``data``                            ``aux``                                module
============  ==================================  =====================================  ===========
none          raw elements in ``frame.dtype``     empty                                  none.py
fp16, bf16    numel float16 / bfloat16            empty                                  cast.py
int8          numel int8, row-major (R, C)        R float32 scales                       int8.py
topk:F        k float32 values                    k int32 flat indices, increasing       topk.py
subspace:I    the inner codec I's ``data`` for    activations: (B, T) token ids; then    subspace.py
              the coefficients, float32 (B, T, k) I's ``aux``
============  ==================================  =====================================  ===========

:mod:`.codec` says what a codec is and holds what they share; :mod:`.registry` maps each name of the
grammar to its codec and dispatches :func:`make_encoder` and :func:`decode` through it; :mod:`.links`
simulates the swarm's boundary links in one process (:class:`LinkSimulator`). :func:`decode` checks the
codec name, dtype, shape, limits and exact byte counts before it allocates, then index ranges and
scales, and raises :class:`ProtocolError` naming the peer on any violation.
"""

from protolearn.codec_spec import CODECS, DEFAULT_TOPK_FRACTION, CodecSpec, CodecSpecError, parse_codec_spec
from protolearn.protocol.codecs.codec import FLOAT_DTYPES, MAX_SUBSPACE_DRIFT, Codec, CodecContext, EncodeStats, Encoder
from protolearn.protocol.codecs.int8 import MAX_INT8_SCALE
from protolearn.protocol.codecs.links import LinkSimulator
from protolearn.protocol.codecs.registry import REGISTRY, decode, make_encoder
from protolearn.protocol.codecs.subspace import token_ids
from protolearn.protocol.codecs.topk import MAX_TOPK_RESIDUALS, TopKEncoder

__all__ = [
    "CODECS", "DEFAULT_TOPK_FRACTION", "FLOAT_DTYPES", "MAX_INT8_SCALE", "MAX_SUBSPACE_DRIFT", "MAX_TOPK_RESIDUALS", "REGISTRY",
    "Codec", "CodecContext", "CodecSpec", "CodecSpecError", "EncodeStats", "Encoder", "LinkSimulator", "TopKEncoder",
    "decode", "make_encoder", "parse_codec_spec", "token_ids",
]
