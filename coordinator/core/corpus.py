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

:func:`decide_corpus` is the rule; :class:`CorpusDesk` holds the swarm's fingerprint and answers the
checks with it, and the store persists the fingerprint whenever it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm

log = logging.getLogger("protolearn.coordinator")


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


class CorpusDesk:
    """The swarm's corpus fingerprint (None until stage 0 said), and whether the store has it yet."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.fingerprint: str | None = None
        self._unsaved: str | None = None

    def restore(self, fingerprint: str | None) -> None:
        self.fingerprint = fingerprint

    def check(self, member: Member, fingerprint: str) -> cm.CorpusCheckReply:
        """``member`` loaded data with ``fingerprint``: its vote if it is in stage 0, then the rule's answer."""
        if member.stage == 0:
            self.registry.vote_corpus(member.peer_id, fingerprint)
        d = decide_corpus(self.fingerprint, member.stage, fingerprint, self.registry.corpus_votes)
        if d.code:
            raise Refusal(d.code, d.reason)
        if d.fingerprint != self.fingerprint:
            log.log(logging.WARNING if d.replaced else logging.INFO, "corpus fingerprint set by peer=%s fingerprint=%s votes=%d",
                    member.peer_id, fingerprint[:16], self.registry.corpus_votes(fingerprint))
            self.fingerprint = self._unsaved = d.fingerprint
        return cm.CorpusCheckReply(fingerprint=fingerprint, first=d.first)

    def drain(self) -> str | None:
        """The fingerprint to persist, when it changed since the last drain."""
        out, self._unsaved = self._unsaved, None
        return out
