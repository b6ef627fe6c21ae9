"""A discrete-event simulator of a protolearn swarm that drives the real sans-IO cores (``scripts/simulate.py``)."""
