"""Joining: dial the coordinator, check its peer ID and its run, and pick the compute device.

Every failure is one :class:`~protolearn.node.errors.JoinError` line that says what to do. The first
dial is made without retries, because at start an unreachable coordinator is a user error (a wrong
address or peer ID), not a network blip.
"""

from __future__ import annotations

import torch

from protolearn.errors import ConfigError
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink, RetryPolicy
from protolearn.node.errors import JoinError
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError, Refused
from protolearn.protocol.transport import Host
from protolearn.stages.config import RunConfig


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was given but torch sees no CUDA device; use --device cpu or auto")
    return device


async def join_coordinator(host: Host, config: NodeConfig) -> tuple[CoordinatorLink, cm.JoinReply, RunConfig]:
    """Dial and join the coordinator; check its run. Every failure is one JoinError line."""
    try:
        # Dial once without retries first: at start, an unreachable coordinator is a user error.
        await host.connect(config.coordinator, timeout=min(10.0, config.request_timeout_s))
    except ProtocolError as err:
        raise JoinError(f"cannot reach the coordinator at {config.coordinator}: {err.reason}; check the address (including its /p2p/ peer id) and that the coordinator is running") from None
    link = CoordinatorLink(host, config.coordinator, retry=RetryPolicy(request_timeout_s=config.request_timeout_s))
    device = resolve_device(config.device)
    try:
        joined = await link.join(cm.Join(addrs=host.addrs()[: cm.MAX_ADDRS], device=device, name=config.name))
    except Refused as err:
        raise JoinError(f"the coordinator refused to let this node join: {err.reason}") from None
    except ProtocolError as err:
        raise JoinError(f"joining the coordinator failed: {err.reason}") from None
    # Validating the run also parses its codec with the one codec grammar (protolearn.codec_spec) that
    # the codecs use, so a run that validates here is one this node can encode and decode.
    run = RunConfig.from_toml_text(joined.run_toml, source="the coordinator's run config")
    if run.run_hash() != joined.run_hash:
        raise JoinError(f"the coordinator's run hash {joined.run_hash[:12]} does not match its run config ({run.run_hash()[:12]}); the coordinator and this node run different protolearn versions")
    return link, joined, run
