"""An honest ``--bf16`` node is never convicted, and a liar still is (issue 25; protolearn/precision.py).

``scripts/bench_integrity.py``'s swarm on a run that admits fp32 and bf16, with spot checks at rate 1.0:
two + two nodes, then a ``scale`` adversary and a ``--bf16`` node (CPU autocast) start together: each joins
as the third replica of a stage (the bf16 node the third honest one of its stage). Every output the bf16 node sends is recomputed
in fp32 by its stage's other replicas, and it recomputes theirs; its self-test compares its bf16 result
with fp32 donors. Over 40 steps nobody but the adversary is banned, and the adversary is.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_integrity import _bench

STEPS = 40
BF16_NODE = 5
ADVERSARY = 4


def test_a_bf16_replica_is_never_banned_while_a_scale_liar_is(tmp_path: Path) -> None:
    bench = _bench()
    r = bench.scenario(tmp_path, kind="scale", steps=STEPS, rate=1.0, bf16=True, timeout_s=400)
    honest = [s for k, s in enumerate(r["stages"]) if k != ADVERSARY]  # the adversary may be gone before node5 joins
    assert r["stages"][BF16_NODE] is not None and honest.count(r["stages"][BF16_NODE]) == 3, r  # one of its stage's 3 replicas
    built = bench._events(tmp_path, BF16_NODE, "built")
    assert built and all(b["precision"] == "bf16" for b in built), built
    # One self-test per state download ("synced"): the join's, and one more for each resync (a round that
    # lost the banned liar mid-step, or a donor that no longer keeps the round a late joiner needs, makes it
    # take a replica's state again). Not per "resync" event: a resync logs two (the core's, with its reason,
    # and the node's), which counted one download twice.
    tests = [e["result"] for e in bench._events(tmp_path, BF16_NODE, "self_test")]
    downloads = bench._events(tmp_path, BF16_NODE, "synced")
    assert downloads and tests == ["passed"] * len(downloads), (tests, downloads, r)
    assert r["detected"] and "integrity" in r["bans"]["node4"], r
    assert r["false_positives"] == 0, r["bans"]
    assert r["steps_closed"] == STEPS, r
