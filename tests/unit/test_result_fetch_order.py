"""Whom a left-out replica asks first for a round's result (node/result_fetch.py ``ask_order``).

The simulator check (docs/BENCHMARKS.md) found every taker of a step asking the participant with the lowest peer
id first, so that one uplink carried every fetch. Each taker now has an order of its own, from a hash of itself,
the round and the participant: the first asks of many takers fall evenly on the participants.
"""

from __future__ import annotations

from collections import Counter

from protolearn.node.result_fetch import ask_order

PARTICIPANTS = [f"12D3KooWparticipant{k}" for k in range(4)]
TAKERS = [f"12D3KooWtaker{k:03d}" for k in range(400)]


def test_a_taker_asks_every_other_participant_once_and_never_itself() -> None:
    me = PARTICIPANTS[2]  # a participant whose own round failed fetches from the others
    order = ask_order(me, 7, PARTICIPANTS + [PARTICIPANTS[0]])
    assert sorted(order) == sorted(set(PARTICIPANTS) - {me})
    assert ask_order(me, 7, reversed(PARTICIPANTS)) == order  # the weights' order does not matter
    assert ask_order("12D3KooWalone", 7, []) == []


def test_the_first_asks_of_a_rounds_takers_spread_over_its_participants() -> None:
    firsts = Counter(ask_order(t, 7, PARTICIPANTS)[0] for t in TAKERS)
    print("first asks per participant, 400 takers:", dict(firsts))
    assert set(firsts) == set(PARTICIPANTS)
    # 100 each on average; the ids are fixed, so this is one deterministic draw (it gave 93-104).
    assert all(70 <= n <= 130 for n in firsts.values()), firsts


def test_a_taker_does_not_ask_the_same_participant_first_in_every_round() -> None:
    firsts = {ask_order(TAKERS[0], r, PARTICIPANTS)[0] for r in range(40)}
    assert len(firsts) == len(PARTICIPANTS)
