"""The host's peer store: py-libp2p's, sized for the host's connections and never evicting the host itself.

py-libp2p 0.8.1's ``PeerStore`` holds at most 1,000 peers. Past that it evicts, on every address added,
the entries with no addresses first, and the host's own entry (its key pair, no addresses) is one of
those: the next identify exchange then fails ("peer ID not found" for its own public key), and the
exception takes the host down. A coordinator met that at about a thousand members (measured with
``bench.py coordinator-net``). :class:`HostPeerStore` holds ``max_peers`` entries (a few per connection
the host may have) and keeps the host's own entry out of the eviction.
"""

from __future__ import annotations

from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

# Entries per connection the host may hold: peers come and go faster than their entries expire.
PEERS_PER_CONNECTION = 4
# py-libp2p's own bound, kept as the least.
MIN_PEERS = 1000


class HostPeerStore(PeerStore):
    def __init__(self, max_connections: int) -> None:
        super().__init__(max_records=max(2000, PEERS_PER_CONNECTION * max_connections),
                         max_peers=max(MIN_PEERS, PEERS_PER_CONNECTION * max_connections))
        self.own: ID | None = None

    def _enforce_peer_limit(self) -> None:
        own = self.peer_data_map.pop(self.own, None) if self.own is not None else None
        try:
            super()._enforce_peer_limit()
        finally:
            if own is not None:
                self.peer_data_map[self.own] = own  # type: ignore[index]


__all__ = ["HostPeerStore"]
