"""`python scripts/bench.py abuse --quick`: every attack runs against a real target and reports the honest side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repo
STREAM_ATTACKS = ("idle_streams", "trickle_streams", "pre_round_flood", "bulk_slots", "bulk_threads", "join_flood", "view_flood")
# Issue 27: members that joined normally and lie with what they can sign, against an honest swarm that trains.
MEMBER_ATTACKS = ("round_suspicion", "round_fin_liar", "role_claims", "liveness_reports", "ban_evasion", "stage_steering", "ack_replay",
                  "long_poll_slots")


def test_abuse_suite_reports_each_attack_and_the_honest_peer_is_served() -> None:
    argv = [sys.executable, "scripts/bench.py", "abuse", "--json", "--quick"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert result["suite"] == "abuse" and set(result["attacks"]) == set(STREAM_ATTACKS + MEMBER_ATTACKS)
    # Why an honest op failed (what the step waited on), not the transport's noise about the attackers' streams.
    why = "\n".join(line for line in out.stderr.splitlines() if line.startswith("honest "))[-6000:]
    for name, attack in result["attacks"].items():
        assert attack["honest_ok"] is True, f"{name}: {json.dumps(attack)}\n{why}\n{out.stderr[-2000:]}"
        assert attack["latency_ratio"] > 0 and isinstance(attack["mem_growth_bytes"], int), name
    attacks = result["attacks"]
    # The attacks were really refused at the target's gates.
    assert attacks["idle_streams"]["node_rejected"] > 0 and attacks["idle_streams"]["coordinator_rejected"] > 0
    # The member attacks really ran, and each was answered as the rule it attacks says.
    assert attacks["round_suspicion"]["messages_lying"] > 0
    assert attacks["round_fin_liar"]["lying_fins"] > 0 and any(f.startswith("round_fault:") for f in attacks["round_fin_liar"]["liar_flags"])
    assert attacks["role_claims"]["draws"] > 0 and sum(attacks["role_claims"]["evidence_refused"].values()) > 0
    assert attacks["liveness_reports"]["reports"] > 0
    assert attacks["ban_evasion"]["banned_key_refused"] > 0 and attacks["ban_evasion"]["banned_key_answered"] == 0
    assert attacks["stage_steering"]["joins"] > 0 and attacks["stage_steering"]["placements_over_slack"] == 0
    assert attacks["ack_replay"]["refused_bad_ack"] > 0 and attacks["ack_replay"]["accepted"] == 0
    assert attacks["long_poll_slots"]["sybil_polls_refused"] > 0, "the Sybils really filled the long-poll slots"
    assert result["all_honest_ok"] is True
