"""Part ownership of the collective: parts cover the vector once, the owner and its backup follow the
chain past suspected peers, a part's value depends only on its contributor set, and a reduced part
reaches the successor before anyone else."""

from __future__ import annotations

import itertools

import torch
from protolearn.protocol.collective.ownership import Broadcast, owner, part_bounds, reduce_part, successor

PEERS = ["a", "b", "c", "d"]


def test_part_bounds_cover_the_vector_once() -> None:
    for numel in range(30):
        for parts in range(1, 7):
            bounds = part_bounds(numel, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(b[1] == c[0] for b, c in itertools.pairwise(bounds))


def test_the_owner_is_the_first_unsuspected_peer_of_the_chain_and_the_backup_is_the_next() -> None:
    assert owner(PEERS, 2, set(), "a") == "c"
    assert owner(PEERS, 2, {"c"}, "a") == "d"
    assert owner(PEERS, 3, {"d"}, "a") == "a", "the chain wraps around"
    assert successor(PEERS, 2, "c", set()) == "d"
    assert successor(PEERS, 2, "c", {"d", "a"}) == "b"
    assert successor(PEERS, 2, "c", {"a", "b", "d"}) is None


def test_a_part_over_the_same_set_has_the_same_bytes_whatever_order_the_slices_came_in() -> None:
    gen = torch.Generator().manual_seed(0)
    slices = {p: torch.randn(5, generator=gen) * 1e3 for p in PEERS}
    weights = {"a": 3.0, "b": 1.0, "c": 7.0, "d": 2.0}
    members = {"a", "c", "d"}
    one = reduce_part(slices, members, weights, "weighted_mean", 5)
    other = reduce_part(dict(reversed(list(slices.items()))), list(reversed(sorted(members))), weights, "weighted_mean", 5)
    assert torch.equal(one, other)
    assert torch.allclose(one, (3 * slices["a"] + 7 * slices["c"] + 2 * slices["d"]) / 12)
    assert torch.equal(reduce_part(slices, set(), weights, "sum", 5), torch.zeros(5))


def test_a_reduced_part_goes_to_the_successor_first_and_to_a_new_successor_if_it_dies() -> None:
    b = Broadcast()
    assert b.next_peers("b", ["b", "c", "d"]) == ["b"]
    assert b.next_peers("b", ["b", "c", "d"]) == [], "the others wait for the successor's acknowledgement"
    b = Broadcast()
    b.next_peers("b", ["b", "c", "d"])
    assert b.next_peers("c", ["c", "d"]) == ["c"], "b died before acknowledging: c is the backup now"
    b.delivered("c")
    assert b.next_peers("c", ["c", "d"]) == ["d"]
    assert b.next_peers("c", ["c", "d"]) == [], "each peer gets the part once"
    assert Broadcast().next_peers(None, []) == [], "no live peer: nothing to send"
