"""Suite-wide settings: one printed, overridable seed for every random choice, and Hypothesis on a loaded machine.

The seed. Every random choice a test makes comes from one seed: the ``test_seed`` and ``rng``
fixtures below, and Hypothesis (its ``--hypothesis-seed``). It is ``DEFAULT_SEED`` unless
``PROTOLEARN_TEST_SEED`` says otherwise, so a run repeats the same choices; the seed is printed in
the report header and in a failing test's captured output, and ``PROTOLEARN_TEST_SEED=N pytest ...``
repeats (or, with a new N, varies) a run. An explicit ``--hypothesis-seed`` still wins for Hypothesis.

Hypothesis. No deadline per example and no "too slow" health check: a property test asserts what
its code returns, and on a loaded 2-core machine the first examples (imports, allocator warm-up) or
the data generation can take seconds, which is not a bug. The other health checks do not depend on
timing and stay on.

Torch threads. Under pytest-xdist (``scripts/test.sh``: two workers on two cores) each worker computes with
one torch thread: at torch's default of one per core, the two workers' four threads spun against each other,
and against the busy loop of a loaded CI run (tests/unit/test_precision.py's trainer: 7 s alone, 15 s beside
the other worker, 150 s with the cores kept busy). Node processes the tests start keep torch's default.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

SEED_ENV = "PROTOLEARN_TEST_SEED"
DEFAULT_SEED = 20240901

settings.register_profile("protolearn", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile("protolearn")


def suite_seed() -> int:
    """The seed of this run: ``$PROTOLEARN_TEST_SEED``, else ``DEFAULT_SEED``."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return DEFAULT_SEED
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={text!r} must be an integer") from None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Before Hypothesis's own pytest_configure reads its seed option.
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(suite_seed())
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (the module docstring)
        import torch

        torch.set_num_threads(1)


def pytest_report_header(config: pytest.Config) -> str:
    return f"protolearn test seed: {suite_seed()} (set {SEED_ENV} to change it; Hypothesis uses it too)"


@pytest.fixture
def test_seed(request: pytest.FixtureRequest) -> int:
    """This test's seed, derived from the run's seed and the test's id, and printed."""
    seed = random.Random(f"{suite_seed()}:{request.node.nodeid}").randrange(2**32)
    print(f"{request.node.nodeid}: seed {seed} (from {SEED_ENV}={suite_seed()})")
    return seed


@pytest.fixture
def rng(test_seed: int) -> random.Random:
    """A ``random.Random`` seeded with :func:`test_seed`: take every random choice of a test from it."""
    return random.Random(test_seed)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run the test with one torch thread: on tiny models and tensors, thread start-up and spinning cost
    more than they save on a shared 2-core box. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
