"""The libp2p adapter: a host over TCP + Noise + yamux, request/response and framed streams.

Public API (other packages code against these names)::

    config = TransportConfig(request_timeout_s=30.0, chunk_timeout_s=10.0, ...)
    async with open_host(identity, ["/ip4/127.0.0.1/tcp/0"], config) as host:
        host.peer_id -> str; host.addrs() -> list[str]            # full multiaddrs ending in /p2p/<id>
        await host.connect("/ip4/.../tcp/.../p2p/<id>", timeout=None) -> str   # the peer id
        host.add_peer_addrs(peer_id, ["/ip4/.../tcp/..."])    # new addresses also clear its failed dials
        host.retain_dial_failures(members)   # the coordinator's view: others' failed dials are forgotten
        host.dial_book -> DialBook           # whose dials failed lately; a dial by ID waits out its back-off
        host.serve(name, handler, request_type=Req, max_inbound=None, max_bytes=None, max_inbound_per_peer=None)  # -> reply
        host.serve_stream(name, handler, max_inbound=None, max_inbound_per_peer=None,   # handler(peer_id, FramedStream)
                          known=None, max_inbound_unknown=None)   # peers known(p) is False for share max_inbound_unknown
        await host.request(peer, name, msg, ReplyType, timeout=None) -> reply
        async with host.open_stream(peer, name, timeout=None) as s: ...   # a FramedStream
        host.ban(peer_id, reason); host.unban(peer_id); host.is_banned(peer_id) -> bool  # for good
        host.ban_reason(peer_id) -> str | None   # why it is refused now: banned for good or for a while
        host.gate.rejected: Counter[str]; host.gate.recent: deque[Rejection]  # see protocol/gate.py
        host.clock -> Clock  # the transport's one clock (rejection log, bulk lane); open_host(..., clock=) fakes it
        host.requests_served -> int; host.active_streams(name, peer=None) -> int
        host.bulk -> BulkLane | None        # None when config.bulk is off; .stats (BulkStats), .ip, .port
        await host.reserve(relay_addr, timeout=5) -> str   # a relay slot; our "<relay>/p2p-circuit/p2p/<id>" address
        host.path_to(peer) -> "direct" | "hole-punched" | "relayed" | None
        host.observed_addr(peer) -> (ip, port) | None; host.local_port(peer) -> int | None; await host.disconnect(peer)
        host.punch = True; host.public_ip = None   # hole punching after a relayed dial; the IP a punch offers
    async with open_host(identity, listen, config, relay=RelayLimits()) as relay: ...   # relays for others

``identity`` is anything with ``private_bytes`` (the 32-byte Ed25519 seed), e.g.
:class:`protolearn.protocol.identity.Identity`. ``peer`` arguments take a peer ID or a full multiaddr.

How it works. The host offers **Noise only** (a default py-libp2p host also accepts plaintext, which
would make peer IDs meaningless), yamux only, one connection per peer (more makes every dial wait
250 ms), no mDNS/UPnP. Protocol IDs are ``/protolearn/<name>/1.0.0``. Each request opens a new stream
(about 3 ms on an existing connection) carrying one length-prefixed request and one reply; a new
stream per request keeps a slow reply from blocking others and needs no request IDs.

Every inbound stream passes the sans-IO :class:`~protolearn.protocol.gate.Gate` before a byte is read:
a banned peer's stream is reset, and so is a stream over the protocol's limit of concurrent inbound
streams, in total or from that peer (never queued). A peer that keeps hitting its limits, or holds
streams idle or trickling past the whole-message deadline, is banned for a while
(``TransportConfig.abuse_*``, ``temp_ban_s``; see :mod:`protolearn.protocol.gate`). A banned peer's connection is also closed as soon as it is established. Every
rejection is counted in ``host.gate`` and logged on the ``protolearn.protocol`` logger as ``rejected
peer=<id> protocol=<name> reason=<reason>``: a peer's first rejection in an interval
(``TransportConfig.rejection_log_interval_s``) in full, the rest in one summary line with their count
when the interval ends, so a peer that sends garbage as fast as it can costs two lines per interval.
A request that fails to decode gets an ErrorReply naming the reason. A handler that raises a
:class:`ProtolearnError` sends back an :class:`ErrorReply`; anything else is logged with the peer,
protocol and reason, the stream is reset, and the host keeps serving. A request handler itself has no deadline: the caller's ``request`` timeout bounds the wait.

Three py-libp2p 0.8.1 behaviours are worked around here: it keeps a connection the remote closed and
then refuses to redial, it refuses any dial for 60 s after a failed one, and identify replaces the
addresses we dialled with the ones the peer advertises (``/ip4/0.0.0.0/...`` for a wildcard
listener, which another machine cannot dial). Each would leave a peer that restarts unreachable, so
before dialling the host drops dead connections, forgets py-libp2p's record of past dial failures
and restores the addresses it was given (by ``connect`` or ``add_peer_addrs``). In place of that 60 s
refusal the host keeps its own, shorter one (:mod:`protolearn.protocol.dial_book`): after two failed
dials in a row, a dial of that peer by ID is tried once per back-off (2 s, doubling to 16 s) and
refused at once otherwise, until the peer connects or its addresses or membership change, so a dead
replica is dialled a few times, not ten a second, before the coordinator's view drops it.

Lifetime. The host works until its ``async with open_host(...)`` block exits, also while that block
is being cancelled: the libp2p swarm and the host's own services run in a task of their own under a
shielded cancel scope, and the block's exit stops them (within ``2 * connect_timeout_s``). The
reason: ``protolearn node join`` stops on SIGINT/SIGTERM by cancelling everything the node runs in,
and then says goodbye to the coordinator from a shielded ``finally`` inside the host's block. Had the
swarm's tasks been cancelled along with the node, the swarm would close its connections and stop its
service manager first, the goodbye would redial into a stopped swarm ("Lifecycle reconcile pruned 1
phantom connection(s)", then ``[ADDCONN_FAIL] ... LifecycleError('Cannot schedule task after service
has stopped')``) and fail, and the coordinator would find the node gone only when it expired.

py-libp2p's auto-connector is stopped as the host starts. It dials peers from the peerstore (any peer
with an address, not connected and not backing off) to keep about 200 connections: every 30 s, every
10 s while under 50, and after each disconnect. A protolearn host dials only on purpose (the
coordinator, and the peers its protocols name); background dials would connect every node to every
member it has heard of and race our redials of a peer that just died.

The bulk lane (:mod:`protolearn.protocol.transport.bulk`, on by default: ``TransportConfig.bulk``,
``bulk_min_bytes``, ``bulk_connect_timeout_s``): a host also listens on a plain TCP port on its listen
IP, and a tensor payload of at least ``bulk_min_bytes`` goes over a direct AES-GCM-sealed connection
whose key is agreed on the Noise-authenticated stream, several times faster than py-libp2p's yamux.
``send_tensor``/``receive_tensor`` pick it on their own and fall back to the stream when it cannot
be dialled, so callers do not change.

Behind a NAT (:mod:`~protolearn.protocol.transport.relay`, :mod:`~protolearn.protocol.transport.holepunch`).
A node that cannot accept connections reserves a slot on a relay and is known to its peers only by its
relayed address. ``connect``/``request``/``open_stream`` to such a peer dial through the relay (the
swarm cannot dial those addresses, and must not dial the private ones the peer's identify reports);
the side that opened the circuit then tries once, bounded, to punch a direct TCP connection (DCUtR),
on which later streams run. The bulk lane is used only on plain direct connections: through a relay
its dial would reach the relay's IP, and a punched hole is open for one port, not the lane's.

The modules. ``host.py``: :class:`Host`, a facade over the rest, and :func:`open_host`. ``names.py``:
protocol and peer IDs. ``dialing.py``: where peers are reached and how they are dialled.
``serving.py``: inbound streams behind the gate. ``gatekeeper.py``: bans carried out on connections,
and the gate's logs. ``connections.py``: what a live connection says about a peer.
``libp2p_errors.py``: py-libp2p's errors. ``streams.py``: framed streams (:class:`FramedStream`).
``bulk.py``, ``bulk_offers.py``, ``seal.py``: the bulk lane. ``relay.py``: circuit relay (its
bookkeeping, pure, is ``protocol/relay_book.py``). ``holepunch.py``: DCUtR. ``config.py``,
``clock.py``: the transport's settings and its one clock. The transport's pure cores live outside this
package, where the purity test checks them: the gate (``protocol/gate.py``), its log
(``protocol/log_digest.py``) and the relay book.
"""

from protolearn.protocol.relay_book import RelayLimits
from protolearn.protocol.transport.bulk import BulkLane, BulkStats
from protolearn.protocol.transport.clock import Clock
from protolearn.protocol.transport.config import TransportConfig
from protolearn.protocol.transport.host import Host, open_host
from protolearn.protocol.transport.names import protocol_id
from protolearn.protocol.transport.streams import FramedStream, TensorHeader, TensorTrailer

__all__ = [
    "BulkLane", "BulkStats", "Clock", "FramedStream", "Host", "RelayLimits", "TensorHeader", "TensorTrailer", "TransportConfig", "open_host", "protocol_id",
]
