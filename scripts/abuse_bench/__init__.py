"""The abuse bench's parts (``python scripts/bench.py abuse``; ``scripts/bench_abuse.py`` runs them).

- :mod:`.harness`: starting a target process, and timing the honest operations without and with an attack;
- :mod:`.node_target` and :mod:`.stream_attacks`: a coordinator and a stage's collective as the target, and the
  identities that hold, trickle and flood its streams, parts, lane slots and joins;
- :mod:`.stand_ins`, :mod:`.swarm` and :mod:`.swarm_target`: a small swarm whose replicas run the node's real
  decision core, collective and coordinator link without a model, and a coordinator with such a swarm as the target;
- :mod:`.crew`: the attacker's identities that join that coordinator;
- :mod:`.round_attacks`, :mod:`.report_attacks`, :mod:`.coordinator_attacks`: the attacks of members that joined
  normally and lie with messages they can sign (issue 27).
"""
