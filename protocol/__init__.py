"""The wire protocol: message schemas, framing, tensor frames, codecs, identity and signatures.

Everything here is pure (no trio, no libp2p) except :mod:`protolearn.protocol.transport`, the one
adapter that binds the protocol to libp2p streams; ``tests/integration/test_purity.py`` walks this package and
checks every other module. The layout:

- The envelope and its limits: ``wire.py`` (messages, the msgpack envelope), ``bounds.py`` (limits and
  field types several protocols share), ``errors.py``.
- Messages of each protocol: ``pipeline.py`` (node to node), ``coordination.py`` (node to coordinator)
  with ``status_schema.py`` (the swarm status), ``states.py``, ``rounds.py`` (round ids), ``acks.py``.
- Tensors: ``frames.py`` (header checks without torch), ``tensors.py``, ``codecs/`` (one module per codec).
- The collective all-reduce: ``collective/`` (the round and its parts), and what a third party checks of
  it without torch: ``statements.py`` (signed statements) and ``reducer_check.py`` (a reducer's fault).
- Integrity: ``boundary.py`` (what a stage signs about its outputs), ``monitors.py``, ``probation.py``,
  ``majority.py`` (the strict-majority rule).
- Identity and addresses: ``identity.py``, ``addresses.py``.
- The transport's sans-IO cores: ``gate.py`` and ``log_digest.py`` (who is refused, and its log),
  ``relay_book.py`` (a relay's reservations and circuits).
"""
