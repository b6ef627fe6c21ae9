"""The ``protolearn`` command line: a thin layer that reads files, flags and the environment."""
