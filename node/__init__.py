"""A volunteer node: join, sync, train its stage, average with its replicas, leave."""
