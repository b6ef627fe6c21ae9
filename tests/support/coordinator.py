"""A coordinator core in one line, and its members joined as the wire would join them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.core.run import RunInfo
from protolearn.protocol import coordination as cm
from protolearn.protocol import statements
from protolearn.stages.config import default_run

ADDRS = ["/ip4/127.0.0.1/tcp/9"]
# Fast enough for tests that step through whole runs: a beat a second, members expire after 3 s.
STEP_SETTINGS = CoordinatorSettings(heartbeat_interval_s=1.0, expiry_s=3.0, lease_s=10.0, rate_per_s=1000, rate_burst=1000)
# Tests that name peers "a", "b", ... sign a completion's last-stage acknowledgement with this stand-in (the
# real signed ack is tested with real keys in test_attacks_ledger.py); signatures by real keys still verify.
TEST_ACK = b"test-ack"


def run_info(stages: int = 2, *, microbatches: int = 4, tokens_per_step: int | None = None, **fields: Any) -> RunInfo:
    """A run of ``stages`` one-layer stages (``layers=`` overrides), ``microbatches`` per step."""
    fields.setdefault("name", "test")
    fields.setdefault("run_hash", "h" * 64)
    fields.setdefault("run_toml", "")
    fields.setdefault("layers", (1,) * stages)
    return RunInfo(microbatches_per_step=microbatches, tokens_per_step=tokens_per_step or microbatches * 16, **fields)


def make_core(run: RunInfo | None = None, settings: CoordinatorSettings | None = None, *, started_at: float = 0.0,
              verify: Callable[[str, bytes, bytes], bool] | None = None) -> CoordinatorCore:
    """A core named ``coord`` for ``run`` (default :func:`run_info`), started at ``started_at``."""
    extra = {} if verify is None else {"verify": verify}
    return CoordinatorCore(run or run_info(), settings or CoordinatorSettings(), peer_id="coord", started_at=started_at, **extra)


def join(core: CoordinatorCore, peer: str, now: float = 0.0, *, throughput: float = 100.0, addrs: list[str] | None = None,
         connections: int | None = None, **fields: Any) -> cm.JoinReply:
    """``peer`` joins ``core`` at ``now``; the reply must be a JoinReply (a refusal raises)."""
    msg = cm.Join(addrs=addrs or ADDRS, throughput=throughput, **fields)
    reply = core.handle(peer, msg, now) if connections is None else core.handle(peer, msg, now, connections=connections)
    assert isinstance(reply, cm.JoinReply), reply
    return reply


def verify_test_ack(peer: str, data: bytes, signature: bytes) -> bool:
    """The core's signature check, with :data:`TEST_ACK` accepted as anyone's."""
    return signature == TEST_ACK or statements.verify_ed25519(peer, data, signature)


def default_core(settings: CoordinatorSettings = STEP_SETTINGS) -> CoordinatorCore:
    """A core for the default run that takes :data:`TEST_ACK` as a signature."""
    return make_core(RunInfo.from_run(default_run()), settings, verify=verify_test_ack)


def run_step(core: CoordinatorCore, s0: str, s1: str, now: float, *, commit: bool = True) -> cm.CompleteReply:
    """Lease and complete a whole step through s0 → s1; ``commit``: both stages then report averaging it."""
    B = core.run.microbatches_per_step
    step = core.ledger.step
    last = None
    while core.ledger.step == step:
        lease = core.handle(s0, cm.Lease(max_tickets=B), now)
        assert isinstance(lease, cm.LeaseReply) and lease.indices, lease.reason
        for i in lease.indices:
            last = core.handle(s0, cm.Complete(ack=TEST_ACK, nonce=core.nonce(step, i), step=step, index=i, route=[s0, s1], loss=2.0 + i), now)
    assert isinstance(last, cm.CompleteReply) and last.step_closed
    if commit:
        revision = core.ledger.closed[step].revision
        assert not core.handle(s0, cm.Averaged(step=step, revision=revision), now).committed
        assert core.handle(s1, cm.Averaged(step=step, revision=revision), now).committed
    return last
