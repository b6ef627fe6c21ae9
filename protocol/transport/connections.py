"""What a host's live connections say about a peer: how it is reached, and at which address and port.

py-libp2p keeps every connection to a peer in its network's table, closed ones too, and nests the TCP
socket under its muxer and security layers. :class:`Connections` answers from that table:
:meth:`~Connections.path_to` ("direct", "hole-punched", "relayed" or not connected), and, from the
socket of a live TCP connection, :meth:`~Connections.observed_addr` (where the peer's connection comes
from, behind a NAT its router's address and mapped port) and :meth:`~Connections.local_port` (this
host's own port on it; the two compared tell whether a NAT keeps source ports).
"""

from __future__ import annotations

from typing import Any

from libp2p.abc import IHost, INetConn
from libp2p.connection_types import ConnectionType
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from protolearn.protocol.transport.holepunch import HolePuncher


class Connections:
    """The live connections of host ``lp``; ``puncher`` knows which of them a hole punch made."""

    def __init__(self, lp: IHost, puncher: HolePuncher | None) -> None:
        self._lp = lp
        self._puncher = puncher

    def live(self, peer_id: str) -> list[INetConn]:
        try:
            pid = ID.from_base58(peer_id)
        except Exception:  # base58 and multihash raise several unrelated types
            return []
        return [c for c in self._lp.get_network().get_connections(pid) if not c.is_closed]

    def path_to(self, peer_id: str) -> str | None:
        """How this host reaches ``peer_id`` now: "direct", "hole-punched" (a direct connection a DCUtR
        punch made), "relayed" (only through a relay), or None when not connected."""
        conns = self.live(peer_id)
        if not conns:
            return None
        if all(is_relayed(c) for c in conns):
            return "relayed"
        if self._puncher is not None and peer_id in self._puncher.punched:
            return "hole-punched"
        return "direct"

    def observed_addr(self, peer_id: str) -> tuple[str, int] | None:
        """The (ip, port) that ``peer_id``'s live connection comes from, as this host sees it (behind a
        NAT: the router's address and the port it mapped); None if not connected over TCP."""
        for conn in self.live(peer_id):
            sock = tcp_socket(conn)
            if sock is not None:
                try:
                    ip, port = sock.getpeername()[:2]
                except OSError:
                    continue
                return str(ip), int(port)
        return None

    def local_port(self, peer_id: str) -> int | None:
        """This host's own TCP port on its live connection to ``peer_id`` (None if not connected over TCP).

        Compared with the port the peer saw (:meth:`observed_addr` on its side), it tells whether a NAT
        between them keeps source ports, which TCP hole punching needs."""
        for conn in self.live(peer_id):
            sock = tcp_socket(conn)
            if sock is not None:
                try:
                    return int(sock.getsockname()[1])
                except OSError:
                    continue
        return None


def is_relayed(conn: INetConn) -> bool:
    muxed = getattr(conn, "muxed_conn", None)
    try:
        kind = muxed.get_connection_type() if muxed is not None else conn.get_connection_type()
    except (BaseLibp2pError, AttributeError):
        kind = None
    return kind == ConnectionType.RELAYED or tcp_socket(conn) is None


def tcp_socket(conn: INetConn) -> Any:
    """The trio socket under a connection's muxer and security layers, or None (a relayed connection).

    py-libp2p nests it as muxer -> secure session -> (Noise reader/writer ->) raw connection -> trio
    stream -> socket, under attribute names that differ per layer; a bounded walk finds it."""
    obj: Any = getattr(conn, "muxed_conn", None)
    for _ in range(8):
        if obj is None:
            return None
        sock = getattr(obj, "socket", None)
        if sock is not None and hasattr(sock, "getsockname"):
            return sock
        obj = next((getattr(obj, a) for a in ("secured_conn", "conn", "read_writer", "read_write_closer", "stream") if getattr(obj, a, None) is not None), None)
    return None


__all__ = ["Connections", "is_relayed", "tcp_socket"]
