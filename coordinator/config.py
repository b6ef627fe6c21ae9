"""Settings of the coordinator: timing, leases, rate limits, ban policy and rebalancing.

These are the coordinator's own knobs, not the run's: the run (model, stages, batch) comes from the run
config. Defaults suit a local demo and a small internet swarm; tests shrink the timings.
"""

from __future__ import annotations

from protolearn.protocol.rounds import REVISIONS_PER_STEP
from pydantic import BaseModel, ConfigDict, Field, model_validator


class CoordinatorSettings(BaseModel):
    """Frozen coordinator settings, validated with messages that show the bad values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    heartbeat_interval_s: float = Field(1.0, gt=0)
    # Past max_heartbeats_per_s x heartbeat_interval_s live members the interval grows with their number, so the
    # coordinator answers at most this many heartbeats a second (None: a fixed interval); it never exceeds
    # max_heartbeat_interval_s, and expiry (and every "silent for two intervals" rule) scales with it
    # (coordinator/core/pacing.py).
    max_heartbeats_per_s: float | None = Field(100.0, gt=0)
    max_heartbeat_interval_s: float = Field(60.0, gt=0, le=600.0)  # at most coordination.MAX_HEARTBEAT_INTERVAL_S
    # A member that has not been heard from for this long is expired (its leases are freed); at a longer
    # interval (max_heartbeats_per_s), the same number of intervals.
    expiry_s: float = Field(5.0, gt=0)
    # After a restart, members get this long to reconnect (with backoff) before expiry applies.
    restart_grace_s: float = Field(30.0, ge=0)
    lease_s: float = Field(20.0, gt=0)
    # A member whose connection closed and stayed closed this long has its leases ended early (it died).
    disconnect_grace_s: float = Field(0.5, ge=0)
    # Most tickets one lease request gets: small blocks spread the tickets over stage-0 replicas.
    lease_block: int = Field(4, ge=1)
    housekeeping_interval_s: float = Field(0.25, gt=0)
    # Token bucket per peer over all requests.
    rate_per_s: float = Field(200.0, gt=0)
    rate_burst: float = Field(400.0, ge=1)
    # Ban policy: verified evidence (two statements the accused signed that contradict each other) bans at
    # once when set. Off by default (the operator opts in with --ban-on-evidence): an equivocation shows a
    # peer said two things, not which was wrong, while integrity evidence (below) is checked against two
    # other replicas' recomputations. A report without either never bans on its own word.
    ban_on_evidence: bool = False
    # Integrity evidence the coordinator checks itself (a spot check's three signed outputs of the same
    # inputs, or a signed tensor with NaN/Inf: coordinator/core/integrity.py) bans the convicted peer.
    integrity_bans: bool = True
    # For this long after a ban the banned peer's requests are refused with the ban's reason (so the node
    # can tell its user why); after it, its connections are refused outright.
    ban_notice_s: float = Field(30.0, ge=0)
    # Reports without such evidence are claims: by default (None) they are counted and shown, never a ban,
    # since f Sybil identities are f "distinct" reporters. A number N bans on N distinct reporters (a
    # swarm that trusts its members, e.g. one operator's machines).
    reports_to_ban: int | None = Field(None, ge=1)
    report_window_s: float = Field(300.0, gt=0)
    # Rebalancing: move a node only if the swarm's bottleneck rate rises so that old < quality * new.
    rebalance_quality: float = Field(0.75, gt=0, le=1)
    rebalance_interval_s: float = Field(10.0, gt=0)
    move_cooldown_s: float = Field(60.0, ge=0)
    # Departed (left or expired) members are remembered this long so a rejoin gets its old stage.
    departed_retention_s: float = Field(24 * 3600.0, ge=0)
    # After a ban, new identities joining from the banned member's IP address (as the coordinator's host
    # sees it; loopback is exempt) are refused for this long (``cooldown``): a fresh key is free, an
    # address is not. Known identities (restarts) are not affected. 0: off (coordinator/core/cooldown.py).
    ban_cooldown_s: float = Field(600.0, ge=0)
    # The most of a stage's replicas that one public IP address, and one /24 (IPv6: /64), may hold, as shares
    # of the stage (always at least one replica each); loopback and private addresses are exempt
    # (coordinator/core/address_cap.py).
    max_stage_share_per_ip: float = Field(1 / 3, gt=0, le=1)
    max_stage_share_per_subnet: float = Field(0.5, gt=0, le=1)
    max_members: int = Field(100_000, ge=1)
    # Keep the finished run's model: once its last step commits, members are told (heartbeat replies'
    # ``final``) to stay until the coordinator's adapter has fetched every stage (coordinator start does).
    keep_final: bool = False
    # Step accounting under attack (issue 12). A closed step reopens at most this many times; a redo past
    # it is refused (``revision_cap``) and the last revision stands. At most the round ids a step has.
    max_revisions: int = Field(32, ge=1, le=REVISIONS_PER_STEP)
    # Redos of other peers' work one peer may have granted per step; past it the peer is flagged
    # (``redo_storm``) and its further redos of that step are refused (``redo_limit``).
    max_redos_per_peer: int = Field(8, ge=1)
    # A completion's loss must lie in [0, max_loss_factor * ln(vocab_size)]: ln(V) is an untrained
    # model's loss, and no honest microbatch is that many times worse.
    max_loss_factor: float = Field(10.0, gt=0)
    # A lease held past this fraction of lease_s while its holder completed nothing for as long is late:
    # each late pass strikes the holder, and every strike halves its share of the step (down to 1).
    lease_late_fraction: float = Field(0.5, gt=0, le=1)
    # Liveness (issue 11): a stage-0 member struck this many times for late leases with no completion in
    # between, each time while another stage-0 replica did complete tickets (so the pipeline behind it
    # works), is banned with a ``liveness:`` reason; from its first such strike its leases end at the
    # strike instead of at lease_s. A late completion (even one refused because the ticket went to another
    # replica meanwhile, if the last stage's ack checks out) clears the count, so a slow honest replica
    # is never expelled. None: flag and shrink its share only.
    expel_after_strikes: int | None = Field(4, ge=1)
    # A live replica that has not reported a closed step's result while the rest of its stage has, for
    # this long (or 3 x the recent close-to-commit median, if longer), is no longer waited for by the
    # commit, and takes a ``commit_hold`` strike per such grace; expel_after_strikes of them in a row ban
    # it (coordinator/core/holdups.py).
    commit_grace_s: float = Field(3.0, gt=0)
    # Reports of lost microbatches (a next-stage peer that Acks activations and never sends the gradient
    # back, reason ``liveness: ...``) ban the reported stage-s member only when at least 2 distinct live
    # replicas of stage s-1, and a strict majority of them, reported it within report_window_s; fewer
    # reporters flag it (``lost_microbatches``). False: flag only.
    expel_on_liveness_reports: bool = True
    max_concurrent_waits: int = Field(1024, ge=1)
    # Connections the coordinator's host takes (every member holds one), and inbound ones from one IP address
    # (loopback exempt), so that the raised total cannot go to one address: protocol/transport/inbound.py.
    max_connections: int = Field(12_000, ge=1)
    max_connections_per_ip: int = Field(32, ge=1)
    # A member's claimed throughput counts as at most this many times the swarm's median claim
    # (coordinator/core/assignment.py ThroughputClaims): a liar weighs like this many honest nodes at most.
    throughput_claim_factor: float = Field(4.0, ge=1)
    # A member's state change shows in the view (and bumps its version) at most once per this interval.
    view_state_interval_s: float = Field(1.0, ge=0)
    # No ticket of the first step is leased until this many nodes have joined (core/gathering.py); 1 starts at once.
    start_members: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CoordinatorSettings:
        if self.expiry_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"expiry_s ({self.expiry_s}) must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), "
                "or every member expires between two heartbeats"
            )
        return self
