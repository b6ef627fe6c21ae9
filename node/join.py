"""Joining: dial the coordinator, check its peer ID and its run, and pick the compute device.

Every failure is one :class:`~protolearn.node.errors.JoinError` line that says what to do.

An unreachable coordinator is retried for ``NodeConfig.coordinator_wait_s`` (``--coordinator-wait``,
a minute by default), because it may just be restarting: a node restarted while the coordinator was
down for 3 s used to exit after one failed dial. Retries back off from :data:`FIRST_RETRY_S` to at
most :data:`MAX_RETRY_S` (with jitter, so a swarm's nodes do not dial in lockstep), and each one is
announced as ``waiting for the coordinator at <addr> (attempt N, retry in S s)``. When the time is up
the node fails with the one line it always did. A coordinator that answers with another peer ID is
a wrong address, not a restart, and fails at once.

Once connected, the node asks the coordinator whether the internet can reach it and joins with the
addresses that follow from the answer (see :mod:`protolearn.node.reachability`).

It joins with a fresh session and names the one its data dir's previous process used (the data dir's
``session`` file; the data dir's lock says that process ended): so a node restarted on its data dir
takes its place back at once, while a copy of its key elsewhere is refused as long as it is a member.
"""

from __future__ import annotations

import logging
import os
import random
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import torch
import trio

from protolearn.errors import ConfigError
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused, RetryPolicy
from protolearn.node.errors import JoinError
from protolearn.node.memory import offered_memory
from protolearn.node.reachability import Reachability, establish
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError, Refused, WrongPeer
from protolearn.protocol.transport import Host
from protolearn.stages.config import RunConfig

log = logging.getLogger("protolearn.node")

# Waiting for the coordinator at start: the first retry comes after about FIRST_RETRY_S, each
# later one after twice the last, at most MAX_RETRY_S (times a jitter of 0.5-1), so a coordinator
# that comes back is found within seconds and a dead one costs one refused dial every few seconds.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 4.0
# One dial's deadline (also bounded by the node's request timeout); later dials get what is left of
# the wait, but at least MIN_DIAL_S.
DIAL_TIMEOUT_S = 10.0
MIN_DIAL_S = 2.0
# A join refused because another connection with this identity is still open (``identity_in_use``) is
# tried again this long: the previous run of this very node may have died a moment ago, and the
# coordinator sees its connection close within about a second.
IDENTITY_WAIT_S = 10.0
IDENTITY_RETRY_S = 1.0
SESSION_FILE = "session"


def take_session(data_dir: Path) -> tuple[str, str]:
    """A fresh session for this process, written to ``data_dir``, and the one its previous process wrote
    there ("": none, or unreadable)."""
    path = data_dir / SESSION_FILE
    try:
        previous = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        previous = ""
    session = secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.write_text(session, encoding="ascii")
        os.replace(tmp, path)
    except OSError as err:
        raise JoinError(f"cannot write {path}: {err.strerror}; check that the data dir is writable") from None
    return session, previous if re.fullmatch(r"[0-9a-f]{1,32}", previous) else ""


def resolve_device(device: str) -> str:
    """The torch device for ``--device`` (auto, cpu, cuda, cuda:N or mps); a device torch does not see is one line."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps was given but torch sees no MPS device (Apple GPUs only); use --device cpu or auto")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device} was given but torch sees no CUDA device; use --device cpu or auto")
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            seen = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise ConfigError(f"--device {device}: torch sees {count} CUDA device{'s' if count > 1 else ''} ({seen}); pick one of those, or --device cpu")
    return device


async def wait_for_coordinator(
    host: Host,
    config: NodeConfig,
    *,
    on_wait: Callable[[str], None] | None = None,
    clock: Callable[[], float] = trio.current_time,
) -> None:
    """Dial the coordinator, retrying for ``config.coordinator_wait_s``; then one JoinError line.

    ``on_wait`` gets each ``waiting for the coordinator ...`` line (default: a warning in the log,
    which the CLI shows on stderr).
    """
    say = on_wait or log.warning
    addr = config.coordinator
    deadline = clock() + config.coordinator_wait_s
    full = min(DIAL_TIMEOUT_S, config.request_timeout_s)
    backoff = FIRST_RETRY_S
    attempt = 0
    while True:
        attempt += 1
        try:
            # The first dial gets its full deadline even with --coordinator-wait 0, as it always did.
            await host.connect(addr, timeout=full if attempt == 1 else min(full, max(deadline - clock(), MIN_DIAL_S)))
            return
        except WrongPeer as err:
            raise JoinError(f"cannot reach the coordinator at {addr}: {err.reason}; check the address (including its /p2p/ peer id)") from None
        except ProtocolError as err:
            left = deadline - clock()
            if left <= 0:
                waited = f" (waited {config.coordinator_wait_s:g} s, {attempt} attempts)" if attempt > 1 else ""
                raise JoinError(
                    f"cannot reach the coordinator at {addr}{waited}: {err.reason}; check the address (including its /p2p/ "
                    "peer id) and that the coordinator is running"
                ) from None
        # The last retry comes at the deadline, so the whole wait is used.
        delay = min(backoff * random.uniform(0.5, 1.0), left)
        say(f"waiting for the coordinator at {addr} (attempt {attempt}, retry in {delay:.1f} s)")
        await trio.sleep(delay)
        backoff = min(2 * backoff, MAX_RETRY_S)


async def join_coordinator(
    host: Host, config: NodeConfig, *, on_wait: Callable[[str], None] | None = None,
) -> tuple[CoordinatorLink, cm.JoinReply, RunConfig, Reachability]:
    """Dial (waiting for it, see :func:`wait_for_coordinator`), check this node's reachability and join
    the coordinator; check its run. Every failure is one JoinError line."""
    await wait_for_coordinator(host, config, on_wait=on_wait)
    session, previous = take_session(config.data_dir)
    link = CoordinatorLink(host, config.coordinator, retry=RetryPolicy(request_timeout_s=config.request_timeout_s), session=session)
    device = resolve_device(config.device)
    reach = await establish(host, link.peer, config, say=on_wait)
    # It relays for others only where they can reach it (the transport relays once opened with relay=).
    relay = config.relay and reach.verdict == "public"
    if config.relay and not relay:
        log.warning("--relay: not offering to relay, since the coordinator did not find this node reachable (%s)", reach.verdict)
    request = cm.Join(
        addrs=reach.addrs, device=device, name=config.name, reachability=reach.verdict, relay=relay, precision="bf16" if config.bf16 else "fp32",
        # What its stage may use: the coordinator places it only where the stage's footprint fits.
        memory_gb=offered_memory(device, config.max_memory) / 1e9, max_in_flight=config.max_in_flight, previous_session=previous,
    )
    deadline = trio.current_time() + IDENTITY_WAIT_S
    while True:
        try:
            joined = await link.join(request)
            break
        except CoordinatorRefused as err:
            if err.code == "identity_in_use" and trio.current_time() < deadline:
                (on_wait or log.warning)(f"the coordinator still sees another connection with this node's identity; retrying ({err.detail})")
                await trio.sleep(IDENTITY_RETRY_S)
                continue
            raise JoinError(f"the coordinator refused to let this node join: {err.detail}") from None
        except Refused as err:
            raise JoinError(f"the coordinator refused to let this node join: {err.reason}") from None
        except ProtocolError as err:
            raise JoinError(f"joining the coordinator failed: {err.reason}") from None
    # Validating the run also parses its codec with the one codec grammar (protolearn.codec_spec) that
    # the codecs use, so a run that validates here is one this node can encode and decode.
    run = RunConfig.from_toml_text(joined.run_toml, source="the coordinator's run config")
    if run.run_hash() != joined.run_hash:
        raise JoinError(f"the coordinator's run hash {joined.run_hash[:12]} does not match its run config ({run.run_hash()[:12]}); the coordinator and this node run different protolearn versions")
    return link, joined, run, reach
