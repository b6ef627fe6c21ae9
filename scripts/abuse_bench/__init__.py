"""The abuse bench's parts (``python scripts/bench.py abuse``, :mod:`bench_abuse` runs them).

- :mod:`.harness`: starting a target process, and timing the honest operations without and with an attack;
- :mod:`.node_target`: the target of the stream-level attacks (a coordinator and a stage's collective);
- :mod:`.stream_attacks`: those attacks (idle and trickling streams, part floods, bulk-lane slots, Sybil joins);
- :mod:`.swarm`: a small swarm of replicas that run the node's real decision core and collective, without a model;
- :mod:`.swarm_target`: the target of the member attacks (a coordinator and such a swarm);
- :mod:`.round_attacks`, :mod:`.member_attacks`: the attacks of members that joined normally and lie with
  messages they can sign (issue 27).
"""
