"""Compressed replica sync: what the replicas of a stage send when they average, and why they still apply
the same bits.

Per-step sync (``[sync] mode = "step"``) averages every replica's summed gradient with the collective
(:mod:`protolearn.protocol.collective`). ``[sync] compression`` (:mod:`protolearn.sync_spec`) makes it
send less. The same machinery compresses any flat float32 vector a collective averages (a DiLoCo
pseudo-gradient as well as a gradient): nothing here knows what the vector means.

================  ==========================================================================
``none``          the collective as it always was: raw float32, exact (the swarm equals ``train-local``, I3)
``int8``          every slice as int8 with one power-of-two scale per 64 values; error feedback
``topk:F``        every slice's top fraction F, sparse; error feedback
``powersgd:R``    rank-R factors of every matrix gradient, in two exact rounds; error feedback
================  ==========================================================================

=================  ==========================================================================
``blockfloat``     int8 blocks with power-of-two scales: exact, idempotent projection
``sparse``         top-k chosen from the values alone (ties to the lowest index)
``wire``           the blob a compressed part travels as, and its checked decoding
``slice_codec``    :class:`SliceCodec`: a compression that acts on a round's parts
``feedback``       :class:`ErrorFeedback`: the residual, staged per step, committed when applied
``slice_feedback`` :class:`SliceCompressor`: one replica's ``int8``/``topk`` contributions
``powersgd``       :class:`PowerSGD`: its two rounds, and the deterministic decoding
=================  ==========================================================================

Why survivors still apply identical bits (I2)
---------------------------------------------
The collective's argument rests on a reduced part being a pure function of its contributor set and of
the values the contributors sent, on a part counting only with its reducer's signature over its hash,
and on fins binding the result hash. A slice codec changes three things and keeps each premise:

1. **What a contributor sends** is its *contribution* ``c = contribution(x + e)`` (:class:`SliceCodec`),
   float32 values it computes once, before the round, and keeps. Its slices travel in an encoding that is
   lossless on such values (:mod:`.wire`), so its receivers decode exactly ``c``'s slice, and what it signs
   in a cross-checked round is the hash of those values. To the round, the contributor contributed ``c``.
2. **What an owner does** is reduce over ``S`` exactly as before (robust rules included), then project:
   ``reduced(robust_reduce(S))`` (:meth:`~protolearn.protocol.collective.spec.RoundSpec.reduce`). Both
   projections are deterministic functions of float32 values (exact arithmetic, or a selection that
   depends on the values alone), so the part is still a pure function of ``S`` and the slices: an owner,
   a backup that takes over and a checker that recomputes get the same bits. The owner signs the hash of
   the projected part and everyone, the owner too, holds that part, never the unprojected sum.
3. **What travels is an encoding, what is hashed and signed are the decoded values.** Decoding is a
   pure function of the bytes, checked first (:func:`.wire.decode`), so honest receivers of the same
   bytes hold the same values; a blob that decodes to other values than the signed ones fails the hash
   check like any wrong part. Both projections are idempotent, so an honest sender's encoding loses
   nothing and its receivers decode exactly what it signed.

Nothing in the round's state machine changed (ownership, successor first, counting, ``C``, fins, vetoes):
it runs on float32 values as before, so both arguments of :mod:`protolearn.protocol.collective` (deaths
at any point, and any number of liars) carry over as they are; ``tests/unit/test_sync_collective.py``
runs the fake-clock simulator's deaths and Byzantine schedules with each codec. The reducer cross-check
still works: a checker recomputes the same projection, and a proof carries the contributions as their
contributors signed them; the coordinator checks it with the run's compression
(:func:`~protolearn.protocol.reducer_check.verify_reducer_fault`), and since every round digest binds the
codec (:func:`~protolearn.protocol.statements.op_tag`), a proof cannot be replayed under another one.

PowerSGD is not a slice codec, because its second message depends on the first average. It runs two
ordinary exact float32 rounds (phases 0 and 1 of the step's revision, :mod:`protolearn.protocol.rounds`)
and applies :func:`.powersgd.decode` of their two results, a pure deterministic function: I2 is the
collective's own, twice.

What is lossy, and who keeps it
-------------------------------
* A contributor's own loss (``x + e - c``, or PowerSGD's ``M - U Q_i^T``) is **error feedback**
  (:mod:`.feedback`): per replica, staged per step, committed when the step is applied, forgotten when
  the replica takes another state; never in the parameter hash. A redone step never counts it twice.
* An ``int8`` owner's projection of the reduced part is not fed back: part owners change with
  membership, so nobody could carry it from round to round, and every replica applies the same loss.
  ``topk`` sends its reduced parts as they are.
* ``none`` changes nothing: no codec, no projection, and the round digest and the bytes on the wire are
  those of the uncompressed collective.

A replica the step's accounting left out fetches the round's decoded result (PowerSGD: both rounds'
results, decoded alike), so its commit report names the same result hash as the participants'.
"""

from protolearn.protocol.sync_compression.feedback import ErrorFeedback
from protolearn.protocol.sync_compression.powersgd import PowerSGD
from protolearn.protocol.sync_compression.slice_codec import SliceCodec, slice_codec
from protolearn.protocol.sync_compression.slice_feedback import SliceCompressor

__all__ = ["ErrorFeedback", "PowerSGD", "SliceCodec", "SliceCompressor", "slice_codec"]
