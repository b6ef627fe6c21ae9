"""The fault-tolerant all-reduce among the replicas of one stage: a sans-IO state machine and its parts.

One :class:`CollectiveRound` sums (``op="sum"``) or weight-averages (``op="weighted_mean"``) one flat
float32 vector per replica with a reduce-scatter and an all-gather, and finishes even when replicas
die at any point of it; a replica that lies can make it fail, never make two honest replicas finish
with different results. It never does IO: events take ``now`` and return actions for the adapter
(``node/averaging.py``) to carry out. How a round works is :mod:`.round`'s docstring; this one argues
why it is correct. The modules:

=================  ==========================================================================
``round``          :class:`CollectiveRound`: the events, and what a replica does after each one
``spec``           what every participant agrees on before the round (:class:`~.spec.RoundSpec`)
``header``         the one wire message, :class:`PartHeader`
``actions``        what a round asks the adapter to do: :class:`Send`, :class:`Probe`, :class:`Rejected`,
                   :class:`Done`, :class:`Failed`
``admission``      what a message must be before the round looks at it
``ownership``      who reduces which part, how, and in what order it goes out (successor first)
``scatter``        a contributor's slices, sent to whoever reduces (or checks) each part
``part_ledger``    the signed reduced parts a replica holds, and which of them count
``robust``         the aggregation rules (mean, trimmed mean, CenteredClip), pure functions of a set
``cross_check``    the reducer cross-check: a checker recomputes a part and vetoes a wrong one
``fins``           termination: the signed fins a replica sends and collects
``liveness``       the failure detector: adaptive deadlines, probes, suspicion
``waits``          what a replica waits on, and on whom, as the failure detector's waits
=================  ==========================================================================

The signed statements and the evidence they leave (:mod:`protolearn.protocol.statements`,
:mod:`protolearn.protocol.reducer_check`) stay outside this package: the coordinator checks them, and
starts without torch. A round may carry a slice compression (``codec``); why everything below still
holds then is :mod:`protolearn.protocol.sync_compression`'s docstring.

Why survivors agree (crash-stop peers)
--------------------------------------
A live contributor's slices reach every part's current owner (it resends on every owner change, and
owners wait for every contributor they do not hold out), so ``C`` only ever loses dead peers. Values are
functions of sets, so survivors can only differ by committing different sets. Take one dead peer X.
Suppose a survivor commits ``C`` containing X; then for every part it holds a reduction that includes X.
A reduction without X can only come (a) from an owner that lacks X's slice, or (b) from re-reducing
after seeing a reduction without X, which needs (a) first. For a part other than X's own, the owner
is its live primary, and it produced a reduction with X, so it holds X's slice: no (a). For X's own
part, a survivor's reduction with X came from X itself, and successor-first means the backup got it
before anyone else; taking over, the backup finds that part over its ``C`` and sends it on instead of
reducing without X: no (a). So no reduction without X ever appears, and every survivor converges on
the same ``C``; if no survivor can commit with X, all converge on ``C`` without X, and finish. Two
deaths in one round converge the same way unless a part's owner and its successor both die after the
owner sent its reduction on; a live peer held out because it is slow leaves the others to wait for its
fin. Either way the argument below, which assumes less, still rules out disagreement: such a round
fails or finishes, identically.

Why honest survivors never diverge (Byzantine peers)
----------------------------------------------------
Model: any number of the ``n`` participants may lie. A liar may send anything to anyone at any time
(forged or equivocating parts and fins, false claims, wrong contributor sets, slices that differ per
receiver) and may collude with other liars, but cannot sign for another peer (Ed25519) nor stop honest
peers' messages. Honest peers may crash. Assumption **T**, a timing assumption the crash argument
makes too: an honest replica never finds a live honest replica *unreachable* (it answers probes
before their deadline, its streams do not break). T is about reachability only: an honest replica
that looks stuck, because it waits on a liar, is held out but is never dead.

*Claim: two honest replicas that both finish Done hold the same contributor set and bit-identical
results.* A replica finishes Done only holding, from every peer that is not dead to it, a signed fin
with its own ``C`` and result hash. Take honest A and B, both Done. An honest B never says it left a
round it finishes Done, so by T, B is not dead to A, and A holds B's fin; an honest B signs one fin, for
what it committed, so B's ``C`` and result hash equal A's. Equal result hashes mean equal part hashes,
hence equal parts in order (SHA-256 is collision resistant): the results are equal bit for bit. This
rests on the all-to-all fin check alone, not on any part, claim or count of liars: it holds for any
number of liars among ``n``, under T.

What the checks on parts and claims add (liveness and accountability, with at most ``f = max_liars``
liars), and what a liar can still do:

* A liar can make a round fail, never make honest replicas diverge: an equivocating part or fin, a
  fin that differs from the honest one, a claim sent to an honest replica that it is dead, a part or a
  fin it never sends (the round then waits for its fin until the round's deadline). :class:`Failed`
  is never applied: the node redoes the step, and the commit barrier keeps every replica of the
  stage from applying it. A peer that signs two stories leaves the two statements in
  :attr:`Failed.evidence`, checkable by a third party.
* It cannot make an honest replica count a part signed by a peer that is not the part's owner in its
  eyes (a), a part whose bytes or signature do not match, a sum with a part's first owner in that the
  first owner did not sign, nor drop a live honest contributor by tagging a smaller set (b) or by
  claiming it dead (more than ``f`` claimants are needed; fewer only make the receiver probe). Such
  parts are held and never used.
* As a part's owner (or as the backup of a dead one) it can sign a wrong value and send that same value
  to everyone, with a fin to match: without the cross-check, honest replicas then agree on a wrong part.
  The backup cannot tell, because it holds none of the part's slices (scatter goes to the owner only;
  the cross-check above sends them to the backup too, for 50% more bytes per round, and still fails when
  owner and backup collude). What the backup does check: the owner's hash and signature, that the part's set leaves out
  only peers the backup itself holds out, and, since it gets the part first and relays exactly that
  signed part if the owner dies, that nobody commits another version without the fins showing it. The
  wrong part stays signed, so attributable; its plausibility is the integrity layer's job (statistical
  monitors, robust aggregation).
* If T breaks (a live honest replica unreachable past its deadlines), two honest replicas can each find
  the other dead and commit different results; the node's parameter-hash check after the step is then
  the last line, as for crashes.
"""

from protolearn.protocol.bounds import MAX_PARTICIPANTS
from protolearn.protocol.collective.actions import Action, Done, Failed, Probe, Rejected, Send
from protolearn.protocol.collective.header import PartHeader
from protolearn.protocol.collective.liveness import DEFAULT_FACTOR, DEFAULT_FLOOR_S, EMA_ALPHA, INITIAL_BYTES_PER_S, STUCK_FACTOR, Bandwidth
from protolearn.protocol.collective.part_ledger import MAX_VERSIONS_PER_SIGNER
from protolearn.protocol.collective.robust import Aggregation
from protolearn.protocol.collective.round import DEFAULT_TIMEOUT_S, CollectiveRound, PartFilter
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.statements import SignedStatement

# The adapter and the tests know the collective by these names only.
__all__ = [
    "DEFAULT_FACTOR", "DEFAULT_FLOOR_S", "DEFAULT_TIMEOUT_S", "EMA_ALPHA", "INITIAL_BYTES_PER_S", "MAX_PARTICIPANTS",
    "MAX_VERSIONS_PER_SIGNER", "STUCK_FACTOR", "Action", "Aggregation", "Bandwidth", "CollectiveRound", "Done", "SignedStatement",
    "Failed", "PartHeader", "Probe", "ReducerFault", "Rejected", "PartFilter", "Send",
]
