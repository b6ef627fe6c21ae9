#!/usr/bin/env bash
# The whole test suite, as CI runs it: the unit and integration tests, with the end-to-end tests that assert
# nothing about speed, on two pytest-xdist workers; then the other end-to-end swarms one at a time (marker
# `solo`, tests/e2e/conftest.py). Those start node processes that use every core and time what they do; run
# beside each other they would each measure the other. Plain `.venv/bin/python -m pytest` runs the same
# tests one after another (about five minutes longer on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# (integration first, as a plain run collects it: its test-only wire messages join test_wire's round trips)
.venv/bin/python -m pytest -n "${PROTOLEARN_TEST_WORKERS:-2}" -m "not solo" tests/integration tests/unit tests/e2e
.venv/bin/python -m pytest -m solo tests/e2e
