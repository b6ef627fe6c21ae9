"""What the tests share: a coordinator core and its members, tiny runs, waiting with a deadline, free ports,
the CLI as a subprocess, and the local swarm (the same supervisor ``protolearn demo`` uses).

Each helper lives here once; a test file keeps only what is particular to it.
"""
