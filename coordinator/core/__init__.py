"""The coordinator's decision cores: sans-IO objects that turn (peer, request, ``now``) into a reply.

Everything in this package is pure: no trio, no libp2p, no sockets, no files
(``tests/integration/test_purity.py`` imports every module here and checks). The entry point is
:class:`~protolearn.coordinator.core.dispatch.CoordinatorCore`, whose ``handle(peer, msg, now)``
answers every request; its parts (membership, the ticket ledger, the commit barrier, verdicts, lease
discipline, redo limits, reachability decisions, the status view) are the modules beside it. The
same core runs under the unit tests, the node-core simulator (``tests/unit/node_sim.py``) and the
real swarm.

The IO adapters sit one level up, in ``coordinator/``: ``service.py`` (the trio/libp2p service that
calls the core with the wall clock), ``store.py`` (SQLite: it writes what
:meth:`~protolearn.coordinator.core.dispatch.CoordinatorCore.drain` hands it and reads it back on a
restart) and ``metrics.py`` (the Prometheus endpoint). ``config.py`` and ``errors.py`` beside them
are the vocabulary both sides share.
"""
