"""The wire protocol: message schemas, framing, tensor frames, codecs, identity and signatures.

Everything here is pure (no trio, no libp2p) except :mod:`protolearn.protocol.transport`, the one
adapter that binds the protocol to libp2p streams.
"""
