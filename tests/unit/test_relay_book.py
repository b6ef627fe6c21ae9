"""The relay's bookkeeping (protocol/relay_book.py RelayBook): reservations and circuits against
the limits, with no IO and no clock of its own."""

from __future__ import annotations

import pytest

from protolearn.protocol.errors import PeerUnavailable
from protolearn.protocol.relay_book import Circuit, RelayBook, RelayLimits, is_circuit, split_circuit

RELAY = "12D3KooWRelayRelayRelayRelayRelayRelayRelayRelayRe"
DEST = "12D3KooWDestDestDestDestDestDestDestDestDestDestDe"


def connected(*peers: str):
    return lambda p: p in peers


def test_reservations_fill_up_and_departed_holders_free_their_slot() -> None:
    book = RelayBook(RelayLimits(max_reservations=2, reservation_ttl_s=100))
    assert book.reserve("a", "1.1.1.1", 0.0, connected("a")) == 100.0
    assert book.reserve("b", "2.2.2.2", 0.0, connected("a", "b")) == 100.0
    assert "full (2 reservations)" in str(book.reserve("c", "3.3.3.3", 1.0, connected("a", "b", "c")))
    # Renewing one's own slot is never refused, and extends it.
    assert book.reserve("a", "1.1.1.1", 50.0, connected("a", "b")) == 150.0
    # b left: its slot goes to c at once, before b's reservation would have lapsed.
    assert book.reserve("c", "3.3.3.3", 51.0, connected("a", "c")) == 151.0
    assert not book.holds("b", 51.0) and book.holds("c", 51.0)
    # a lapses at 150 even though still connected.
    assert book.reserve("d", "4.4.4.4", 150.0, connected("a", "c", "d")) == 250.0
    assert not book.holds("a", 150.0)


def test_one_ip_holds_at_most_its_share_of_reservations() -> None:
    book = RelayBook(RelayLimits(max_reservations=10, max_reservations_per_ip=2))
    everyone = lambda p: True  # noqa: E731
    assert isinstance(book.reserve("s1", "6.6.6.6", 0.0, everyone), float)
    assert isinstance(book.reserve("s2", "6.6.6.6", 0.0, everyone), float)
    assert "6.6.6.6 already holds 2 reservations" in str(book.reserve("s3", "6.6.6.6", 0.0, everyone))
    assert isinstance(book.reserve("h", "7.7.7.7", 0.0, everyone), float)  # another address is not affected
    book.release("s1")
    assert isinstance(book.reserve("s3", "6.6.6.6", 0.0, everyone), float)


def test_circuits_are_limited_per_source_per_destination_and_in_total() -> None:
    book = RelayBook(RelayLimits(max_circuits_per_peer=2, max_circuits=4))
    for d in ("d1", "d2", "d3"):
        book.reserve(d, "1.1.1.1", 0.0, connected("d1", "d2", "d3"))
    assert "no reservation" in str(book.open("s", "nobody", 1.0))
    assert "to itself" in str(book.open("d1", "d1", 1.0))
    c1 = book.open("s", "d1", 1.0)
    assert isinstance(c1, Circuit) and isinstance(book.open("s", "d2", 1.0), Circuit)
    assert "source already has 2 circuits" in str(book.open("s", "d3", 1.0))
    assert isinstance(book.open("t", "d1", 1.0), Circuit)
    assert "destination already has 2 circuits" in str(book.open("v", "d1", 1.0))
    assert isinstance(book.open("u", "d3", 1.0), Circuit)
    assert "maximum of 4 circuits" in str(book.open("w", "d2", 1.0))
    book.close(c1)
    book.close(c1)  # closing twice is harmless
    assert isinstance(book.open("s", "d3", 1.0), Circuit)
    assert book.num_circuits == 4


def test_a_circuit_is_charged_for_both_directions_until_its_byte_limit() -> None:
    book = RelayBook(RelayLimits(max_circuit_bytes=1000))
    book.reserve("d", "1.1.1.1", 0.0, connected())
    c = book.open("s", "d", 0.0)
    assert isinstance(c, Circuit)
    assert book.charge(c, 600) is None
    assert "more than its limit of 1000 bytes" in str(book.charge(c, 401))


def test_relayed_addresses_are_parsed_strictly() -> None:
    addr = f"/ip4/198.18.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{DEST}"
    assert is_circuit(addr) and not is_circuit(f"/ip4/198.18.0.1/tcp/4001/p2p/{RELAY}")
    assert split_circuit(addr, "x") == (f"/ip4/198.18.0.1/tcp/4001/p2p/{RELAY}", DEST)
    for bad in (f"/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/{DEST}", f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit", f"{addr}/tcp/1"):
        with pytest.raises(PeerUnavailable, match="not a relayed address"):
            split_circuit(bad, "x")


class _ListeningOn:
    """Just what HolePuncher reads of a py-libp2p host: its listen addresses."""

    def __init__(self, *addrs: str) -> None:
        from multiaddr import Multiaddr

        self._addrs = [Multiaddr(a) for a in addrs]

    def get_addrs(self) -> list:
        return self._addrs


def test_a_punch_dials_only_a_few_routable_tcp_addresses_the_peer_names() -> None:
    from multiaddr import Multiaddr

    from protolearn.protocol.transport.holepunch import MAX_PUNCH_ADDRS, HolePuncher

    named = ["/ip4/10.0.0.5/tcp/22", "/ip4/192.168.1.1/tcp/80", "/ip4/127.0.0.1/tcp/4001", "/ip4/169.254.1.1/tcp/1",
             "/ip4/198.18.0.2/udp/4001", "/ip4/203.0.113.7/tcp/4001"] + [f"/ip4/198.18.0.{i}/tcp/4001" for i in range(2, 10)]
    raw = [Multiaddr(a).to_bytes() for a in named]
    public = HolePuncher(_ListeningOn("/ip4/0.0.0.0/tcp/4002"))  # type: ignore[arg-type]
    kept = [str(a) for a in public._decode_observed_addrs(raw)]
    assert kept == ["/ip4/203.0.113.7/tcp/4001", "/ip4/198.18.0.2/tcp/4001", "/ip4/198.18.0.3/tcp/4001", "/ip4/198.18.0.4/tcp/4001"]
    assert len(kept) == MAX_PUNCH_ADDRS
    # A host that listens on loopback only is in a swarm on one machine: loopback is what its peers are at.
    local = HolePuncher(_ListeningOn("/ip4/127.0.0.1/tcp/4002"))  # type: ignore[arg-type]
    assert "/ip4/127.0.0.1/tcp/4001" in [str(a) for a in local._decode_observed_addrs(raw)]
