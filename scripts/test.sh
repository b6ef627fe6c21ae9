#!/usr/bin/env bash
# The whole test suite, as CI runs it: the unit and integration tests on two pytest-xdist workers, then the
# end-to-end swarms one at a time. The e2e tests start swarms of node processes that use every core and time
# what they do; run beside each other they would each measure the other. Plain `.venv/bin/python -m pytest`
# runs the same tests one after another (about four minutes longer on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# (integration first, as a plain run collects it: its test-only wire messages join test_wire's round trips)
.venv/bin/python -m pytest -n "${PROTOLEARN_TEST_WORKERS:-2}" tests/integration tests/unit
.venv/bin/python -m pytest tests/e2e
