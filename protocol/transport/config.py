"""The transport's deadlines and limits (:class:`TransportConfig`), in one frozen pydantic model.

Read by :mod:`protolearn.protocol.transport.host` (the gate's per-peer limits and temporary bans,
the served requests' deadlines, the bulk lane's bounds) and handed to every
:class:`~protolearn.protocol.transport.streams.FramedStream` (whole-message deadlines and the
minimum rate).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protolearn.errors import ConfigError

from protolearn.protocol import wire
from protolearn.protocol.frames import DEFAULT_LIMITS, TensorLimits
from protolearn.protocol.gate import DEFAULT_ABUSE_THRESHOLD, DEFAULT_ABUSE_WINDOW_S, DEFAULT_MAX_TRACKED, DEFAULT_TEMP_BAN_S
from protolearn.protocol.link import LinkSpec
from protolearn.protocol.log_digest import DEFAULT_INTERVAL_S, DEFAULT_MAX_PEERS


class TransportConfig(BaseModel):
    """Deadlines and limits of the transport. Frozen; every value must be positive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_timeout_s: float = Field(default=wire.DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    chunk_timeout_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    max_message_bytes: int = Field(default=16 * 1024 * 1024, gt=wire.LENGTH_PREFIX.size)
    chunk_bytes: int = Field(default=1024 * 1024, gt=0)
    max_inbound_streams: int = Field(default=64, gt=0)
    # Live connections in all (py-libp2p's cap), inbound handshakes in flight, and inbound connections one IP
    # address may hold (loopback is exempt): protocol/transport/inbound.py. The defaults suit a node; the
    # coordinator, which every member holds a connection to, raises the first (coordinator/config.py).
    max_connections: int = Field(default=300, gt=0)
    max_pending_connections: int = Field(default=64, gt=0)
    max_connections_per_ip: int = Field(default=32, gt=0)
    # Loopback (this machine) is exempt from max_connections_per_ip unless this is set (tests of the cap).
    cap_loopback: bool = False
    # Per-peer limits (issue 12, protocol/gate.py): one peer's concurrent inbound streams per protocol
    # (a protocol's own max_inbound is the cap when lower). A peer over a limit is refused, others are not.
    max_inbound_streams_per_peer: int = Field(default=16, gt=0)
    # Whole-message deadlines: an inbound message or tensor payload of N bytes must arrive in full within
    # max(message_deadline_s, N / min_rate_bytes_per_s) of its start, whatever the per-read deadlines;
    # a served request must start arriving within message_deadline_s of its stream opening.
    message_deadline_s: float = Field(default=10.0, gt=0)
    min_rate_bytes_per_s: float = Field(default=256 * 1024, gt=0)
    # Repeated abuse (stream limit, per-peer buffer limit, idle or too slow): abuse_threshold such
    # rejections within abuse_window_s ban the peer for temp_ban_s, after which the ban expires.
    abuse_window_s: float = Field(default=DEFAULT_ABUSE_WINDOW_S, gt=0)
    abuse_threshold: int = Field(default=DEFAULT_ABUSE_THRESHOLD, gt=0)
    temp_ban_s: float = Field(default=DEFAULT_TEMP_BAN_S, gt=0)
    abuse_max_peers: int = Field(default=DEFAULT_MAX_TRACKED, gt=0)
    tensor_limits: TensorLimits = DEFAULT_LIMITS
    # The bulk lane (protocol/transport/bulk.py): payloads of at least bulk_min_bytes go over a direct
    # AEAD-sealed TCP connection when both hosts have it on; a lane that cannot be dialled falls back.
    bulk: bool = True
    bulk_min_bytes: int = Field(default=1024 * 1024, gt=0)
    bulk_connect_timeout_s: float = Field(default=2.0, gt=0)
    bulk_max_pending_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)  # receive buffers reserved at once
    # ... and per peer: its pending lane transfers (each takes a worker thread while it runs) and bytes.
    bulk_max_pending_per_peer: int = Field(default=4, gt=0)
    bulk_max_pending_bytes_per_peer: int = Field(default=256 * 1024 * 1024, gt=0)
    # Lane connections from one IP that have not yet presented a token (the lane knows no peer id then).
    bulk_max_hellos_per_ip: int = Field(default=16, gt=0)
    # Rejection log lines (protocol/gate.py): a peer's first rejection per interval in full, the rest
    # summarised with counts at the interval's end; at most this many peers are counted apart.
    rejection_log_interval_s: float = Field(default=DEFAULT_INTERVAL_S, gt=0)
    rejection_log_max_peers: int = Field(default=DEFAULT_MAX_PEERS, gt=0)
    # Whether the host runs libp2p's identify exchange with each peer that connects (its listen addresses and
    # protocols into the peer store). The coordinator does not: it reads a member's addresses from its Join, and
    # the exchange (a stream, a negotiation and a signed record each way) was 3 % of its CPU at 5,000 members.
    identify_peers: bool = True
    # The host's emulated access link (protocol/link.py, protocol/transport/link.py): None, unshaped.
    link: LinkSpec | None = None

    @model_validator(mode="after")
    def _link_fast_enough(self) -> TransportConfig:
        # Peers cut a message that arrives slower than min_rate; a link must carry a couple at once.
        floor = 2 * self.min_rate_bytes_per_s * 8
        if self.link is not None and min(self.link.up_bits, self.link.down_bits) < floor:
            raise ValueError(
                f"link {self.link.text}: a rate below {floor / 1e6:.1f}mbit is too slow for the transport, which drops a peer that "
                f"sends slower than {self.min_rate_bytes_per_s * 8 / 1e6:.1f}mbit (min_rate_bytes_per_s)"
            )
        return self


def usable_link(spec: LinkSpec) -> LinkSpec:
    """``spec`` if the transport (with its default limits) can run over it, else ConfigError saying why."""
    try:
        TransportConfig(link=spec)
    except ValidationError as err:
        raise ConfigError(str(err.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")) from None
    return spec


__all__ = ["TransportConfig", "usable_link"]
