"""A node's own settings (not the run's): where it connects, listens, computes and keeps its files.

Frozen and validated; the CLI builds it from flags (flag > env > default) in one place.
"""

from __future__ import annotations

import re
from pathlib import Path

import multiaddr
from pydantic import BaseModel, ConfigDict, Field, field_validator

from protolearn.errors import ConfigError
from protolearn.node.memory import parse_size
from protolearn.protocol.addresses import DEFAULT_LISTEN, parse_multiaddr
from protolearn.protocol.errors import PeerUnavailable
from protolearn.protocol.link import LinkSpec
from protolearn.protocol.transport.config import usable_link
from protolearn.protocol.wire import DEFAULT_REQUEST_TIMEOUT_S


def check_coordinator_address(v: str) -> str:
    """``v`` if it is a full multiaddr ending in ``/p2p/<peer id>``; else ValueError saying what to paste."""
    if not v.startswith("/") or "/p2p/" not in v:
        raise ValueError(f"{v!r} must be a full multiaddr ending in /p2p/<peer id>, as `protolearn coordinator start` prints it")
    try:  # a typo must fail now, not be retried for --coordinator-wait seconds
        multiaddr.Multiaddr(v)
    except Exception as err:  # multiaddr raises several unrelated types for bad text
        why = str(err).split(": ", 1)[-1].split(" (string:")[0]  # its text repeats the address twice
        why = why.replace(v, "the address")  # and a bad peer id's error names it a third time
        raise ValueError(f"{v!r} is not a valid multiaddr ({why[:160]}); copy the line `protolearn coordinator start` prints") from None
    return v


class NodeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str = Field(min_length=1)
    # How long a starting node waits for an unreachable coordinator (it may be restarting), retrying
    # with capped backoff, before it gives up with one error line (0: one dial only).
    coordinator_wait_s: float = Field(default=60.0, ge=0, le=24 * 3600)
    # auto, cpu, cuda, cuda:N (the N-th GPU torch sees) or mps; resolve_device checks that it exists.
    device: str = "auto"
    data_dir: Path
    listen: str = DEFAULT_LISTEN
    threads: int | None = Field(default=None, ge=1, le=1024)
    name: str = Field(default="node", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    bf16: bool = False  # compute under bf16 autocast (CUDA or CPU): declared at join, the run must admit it
    # The memory its stage may use, in bytes (--max-memory 8GB; None: on CUDA the free memory, else not said):
    # reported at join, the coordinator places the node only in a stage whose footprint fits (node/memory.py).
    max_memory: int | None = Field(default=None, gt=0, le=10**15)
    # Microbatches holding activation memory at once (I5); next-step work held while averaging.
    max_in_flight: int = Field(default=8, ge=1, le=1024)
    max_deferred: int = Field(default=16, ge=1, le=1024)
    # Tickets stage 0 asks for per lease request.
    lease_block: int = Field(default=2, ge=1, le=64)
    request_timeout_s: float = Field(default=DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    averaging_timeout_s: float = Field(default=120.0, gt=0)
    sync_timeout_s: float = Field(default=120.0, gt=0)
    # Stop after this many applied steps (None: the run's steps). The demo and tests use it.
    max_steps: int | None = Field(default=None, ge=1)
    # Checkpoints (node/persistence.py): every N applied steps into <data dir>/checkpoints (0: only at
    # leave), keeping the newest few; `checkpoint` is a stage checkpoint to restore an emptied stage from.
    checkpoint_every: int = Field(default=10, ge=0)
    checkpoint_keep: int = Field(default=3, ge=1, le=1000)
    checkpoint: Path | None = None
    # Testing only: "KIND[:from_step]" makes this node attack the swarm (node/adversary.py), if the
    # environment allows it. Parsed by the CLI; None: an honest node.
    adversary: str | None = Field(default=None, max_length=64)
    # NAT traversal: relay for nodes behind NATs when this node is public (``--relay``), and relays to
    # reserve a slot on first when it is private (``--relay-via``, full multiaddrs ending in /p2p/<id>).
    relay: bool = False
    relay_via: list[str] = Field(default_factory=list, max_length=16)
    # Addresses to advertise first (``--announce``): where other machines reach this node when no
    # interface holds that address (port forwarding, a public IP on the router).
    announce: list[str] = Field(default_factory=list, max_length=4)
    # Serve Prometheus metrics of this node on this port (None: no endpoint; 0: any free port).
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # An emulated home link for all of this node's traffic (``--link``, protocol/link.py); None: as is.
    link: LinkSpec | None = None

    @field_validator("coordinator")
    @classmethod
    def _has_peer_id(cls, v: str) -> str:
        return check_coordinator_address(v)

    @field_validator("device")
    @classmethod
    def _device_named(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]{1,3})?", v):
            raise ValueError(f"{v!r} is not a device: use auto, cpu, cuda, cuda:N (the N-th GPU, from 0) or mps")
        return v

    @field_validator("max_memory", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        return parse_size(v) if isinstance(v, str) else v

    @field_validator("relay_via")
    @classmethod
    def _relays_parse(cls, v: list[str]) -> list[str]:
        for addr in v:
            try:  # a typo must fail now, not after the reachability check
                parsed = parse_multiaddr(addr, "--relay-via")
            except PeerUnavailable:
                raise ValueError(f"{addr!r} is not a valid multiaddr; give a relay's full address, e.g. /ip4/1.2.3.4/tcp/4001/p2p/<peer id>") from None
            if not parsed.get_peer_id() or "/p2p-circuit" in addr:
                raise ValueError(f"{addr!r} must be a relay's direct multiaddr ending in /p2p/<peer id>, as the relay prints it")
        return v

    @field_validator("link")
    @classmethod
    def _link_usable(cls, v: LinkSpec | None) -> LinkSpec | None:
        if v is not None:
            try:  # the transport's own floor for the rate, checked now rather than after the join
                usable_link(v)
            except ConfigError as err:
                raise ValueError(str(err)) from None
        return v

    @property
    def log_path(self) -> Path:
        return self.data_dir / "node.jsonl"
