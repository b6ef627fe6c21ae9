"""Which training data the swarm reads: stage 0's majority decides the corpus fingerprint.

Nodes that read the data (stage 0 for the inputs, the last stage for the targets) must read the same
tokens, so each one sends its corpus fingerprint (``CorpusCheck``) once it has loaded the data.
Anyone may join and be assigned stage 0, so the first fingerprint cannot simply be kept forever: a
lone liar that checked in first would otherwise refuse every honest node. The rule:

- Only stage-0 members vote: one vote each (their latest check), counted while they are live stage-0
  members (the registry keeps the counts as members come and go, :meth:`Registry.corpus_votes`).
- The first vote sets the fingerprint. A fingerprint with *more* votes than the current one replaces
  it, so honest replicas outvote a lone first claimer as soon as two of them have checked in. A
  restored fingerprint (after a coordinator restart) counts as one vote until its voters check again.
- A stage-0 check that ties the current fingerprint is ``corpus_disputed``: the node retries while
  more stage-0 replicas check in. Fewer votes is ``corpus_mismatch`` (the node stops, saying why).
- Other stages are only compared with the current fingerprint, and wait (``corpus_pending``) while
  stage 0 has not said.

This is a majority of distinct stage-0 members, so Sybils that hold most of stage 0 can still choose
the data; nothing short of a trusted fingerprint in the run config prevents that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CorpusDecision:
    """``fingerprint``: the swarm's after this check; ``code``: empty if accepted, else the refusal's."""

    fingerprint: str | None
    code: str = ""
    reason: str = ""
    first: bool = False
    replaced: bool = False


def decide_corpus(current: str | None, stage: int, fingerprint: str, votes: Callable[[str], int]) -> CorpusDecision:
    """Judge one check (after a stage-0 sender's vote was counted); ``votes(fp)``: live stage-0 votes for ``fp``."""
    standing = max(1, votes(current)) if current is not None else 0
    if stage == 0 and (current is None or (fingerprint != current and votes(fingerprint) > standing)):
        return CorpusDecision(fingerprint, first=current is None, replaced=current is not None)
    if current is None:
        return CorpusDecision(None, "corpus_pending", "no stage-0 replica has reported its training data yet; retry shortly")
    if fingerprint == current:
        return CorpusDecision(current)
    if stage == 0 and votes(fingerprint) == standing:
        return CorpusDecision(
            current, "corpus_disputed",
            f"stage 0 is split evenly between this node's training data ({fingerprint[:8]}) and {current[:8]}; "
            "retrying while more replicas check in",
        )
    return CorpusDecision(
        current, "corpus_mismatch",
        f"this node's training data ({fingerprint[:8]}) differs from the swarm's ({current[:8]}): "
        "use the other nodes' Python version (the default data is its stdlib) or the same data.path files",
    )
