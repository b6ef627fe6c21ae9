"""The coordinator's long-poll slots (coordinator/core/wait_slots.py): a peer that waits on little is never shut out."""

from __future__ import annotations

import random

from protolearn.coordinator.core.wait_slots import MIN_AGE_S, NODE_WAITS, WaitSlots


def test_below_the_limit_every_wait_gets_a_slot_and_none_is_ended() -> None:
    slots = WaitSlots(limit=3)
    got = [slots.take(p, 0.0) for p in ("a", "a", "b")]
    assert all(t is not None and t.ended is None for t in got)
    assert slots.taken == 3 and slots.holds("a") == 2 and slots.holds("b") == 1


def test_sybils_holding_every_slot_give_one_up_at_once_to_a_node_that_waits_on_less() -> None:
    """Issue 27 (abuse bench ``long_poll_slots``): Sybil members held all the slots with polls no step change
    answers, and every honest replica's poll was refused busy until theirs timed out."""
    slots = WaitSlots(limit=2 * NODE_WAITS)
    nodes = [slots.take(p, 0.0) for p in ["n1"] * NODE_WAITS + ["n2"] * NODE_WAITS]
    assert slots.take("node", MIN_AGE_S / 2) is None, "a node's wait younger than MIN_AGE_S is never cut short"
    assert slots.take("node", MIN_AGE_S).ended == nodes[0].token, "an old enough one gives its slot up"
    slots = WaitSlots(limit=2 * (NODE_WAITS + 1))
    sybil_waits = {p: [slots.take(p, 0.0).token for _ in range(NODE_WAITS + 1)] for p in ("s1", "s2")}
    taken = slots.take("node", MIN_AGE_S / 10)
    assert taken is not None and taken.ended == sybil_waits["s1"][0], (
        "the busiest peer's oldest wait gives its slot up at once: it holds more than a node ever does")
    assert slots.taken == 2 * (NODE_WAITS + 1) and slots.holds("s1") == NODE_WAITS and slots.holds("node") == 1
    # The node's second question takes the other Sybil's, now the busiest.
    second = slots.take("node", MIN_AGE_S / 10)
    assert second is not None and second.ended == sybil_waits["s2"][0]
    # A Sybil holding as many as the busiest, or more than the one it would take from, is refused busy.
    assert slots.take("s1", 5.0) is None
    slots.release(sybil_waits["s1"][0])  # an ended wait's own release is a no-op
    assert slots.taken == 2 * (NODE_WAITS + 1)


def test_a_peer_holding_as_many_as_every_other_is_refused_however_old_their_waits() -> None:
    slots = WaitSlots(limit=2)
    slots.take("a", 0.0)
    slots.take("b", 0.0)
    assert slots.take("a", 100.0) is None and slots.take("b", 100.0) is None
    assert slots.take("c", 100.0) is not None, "a peer that holds none takes a slot from one that holds one"


def test_slots_never_exceed_the_limit_and_counts_match_the_waits_in_any_order() -> None:
    seed = 20261205
    print(f"seed {seed}")
    rng = random.Random(seed)
    slots = WaitSlots(limit=5, min_age_s=1.0)
    live: dict[int, str] = {}
    now = 0.0
    for _ in range(5000):
        now += rng.random() * 0.3
        if live and rng.random() < 0.4:
            token = rng.choice(list(live))
            slots.release(token)
            del live[token]
            continue
        peer = rng.choice("abcdefg")
        before = {p: slots.holds(p) for p in "abcdefg"}
        taken = slots.take(peer, now)
        if taken is None:
            assert slots.taken == 5, "busy only when every slot is taken"
            continue
        live[taken.token] = peer
        if taken.ended is not None:
            victim = live.pop(taken.ended)
            assert before[victim] > before[peer], "only a peer that holds more gives a slot up"
            assert before[victim] == max(before.values()), "and only the busiest"
        assert slots.taken == len(live) <= 5
        assert all(slots.holds(p) == sum(1 for q in live.values() if q == p) for p in "abcdefg")
