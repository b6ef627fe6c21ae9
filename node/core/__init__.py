"""The node's decision cores: plain objects that turn (event, ``now``) into (state, actions), with no IO.

Nothing here imports trio or libp2p (``tests/integration/test_purity.py`` checks it); the modules one level up
(``node/*.py``) are the adapters that carry the actions out over the network and the compute thread.

- :mod:`.closed_step`: :class:`NodeCore`, what a replica does with a closed step (average, fetch, redo,
  commit, apply, resync), with its vocabulary in :mod:`.events`;
- :mod:`.leasing`: stage 0's leases, starts and restarts of tickets;
- :mod:`.accounting`: which microbatch work a replica admits, holds or refuses, and what it accumulated;
- :mod:`.tickets`: one record per ticket, what the replica knows of each microbatch and where its outputs went;
- :mod:`.routing`: the router's decisions over that record: which next-stage peer gets a microbatch, which
  gradient belongs to the attempt held, which hand-overs are lost;
- :mod:`.balancer`: the per-peer statistics those choices rest on (least expected finish time);
- :mod:`.early_parts`: the bounds on collective parts held before their round starts.
"""
