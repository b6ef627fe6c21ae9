"""The coordinator: membership, stage assignment, step accounting, bans and the swarm view."""
