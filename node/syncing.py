"""Where a (re)starting or lagging replica takes its stage's state from, and the checks before it installs it.

:meth:`StageSync.sync` asks the persistence planner first (a checkpoint of this node, or the
deterministic init on a fresh run: :mod:`protolearn.node.persistence`); otherwise it downloads from
the stage's live replicas (a share from each, or everything from one: :mod:`protolearn.node.state_sync`)
and installs a state only if it is the stage's, by this rule (a donor can lie about anything it sends):

- ``applied`` may not exceed the coordinator's frontier (``StageHashes.step``): no replica has
  applied an uncommitted step;
- after ``applied`` ≥ 1 steps, the installed state (its parameters and the optimizer state the replicas
  share: :func:`~protolearn.node.checkpoint.shared_state_hash`) must hash to what a strict majority of the
  replicas reported for step ``X = applied - 1``. Each replica reports its hashes after its last
  ``HASH_HISTORY`` applied steps (a donor trains on while the joiner downloads, so its snapshot is
  often a step or two behind its latest report). The majority is over all the reporting replicas
  (one whose reports do not hold ``X`` does not agree), and ``X`` may not be ``HASH_HISTORY`` or more
  steps older than the lower median of the replicas' latest steps (so a liar alone on an old step is
  no majority of anything). One lying donor, or one lying
  reporter, is a minority. A stage with a single replica has that replica as its only reporter: a
  majority of one, which is all a joiner can know there;
- after 0 steps the state is the deterministic init from the run seed, which this node built itself:
  the installed state must hash to that (no reporter needed, and nobody has one yet);
- the rule is applied to a donor's claim (applied steps, hash) before any tensor is taken, and the download
  then checks each tensor against the digests that add up to that hash (:mod:`protolearn.node.state_sync`);
- with nothing to compare with (the hashes request failed, nobody reported that step yet, or its
  reporters are split), nothing is installed: the check is asked again a few times (a donor's report
  can be a heartbeat behind its state), then the download is refused and retried, with a progress
  line saying what it waits for, until ``sync_timeout_s``. Unchecked state is never installed.
  :func:`judge_state` is that rule, without IO.

After a download, a **self-test** (``IntegrityConfig.self_test``): each donor sent its stage's output on
a fixed input from the run seed, computed with the very state it sent; this node computes the same with
the state it installed and must agree with a strict majority of its donors within 10 × ``check_tolerance``
plus the allowance for the precisions the run admits (``protolearn/precision.py``), or else with what its own
CPU computes with that state in float32: donors alone never stop a node, since one may lie.
A broken GPU or driver thus stops the node with one line (:class:`~protolearn.node.errors.SelfTestError`)
before it touches training. A state from the init or a checkpoint skips the test and says so.

The first replica of a stage has no donors: it keeps the init (or a checkpoint), see
:mod:`protolearn.node.persistence`. While the coordinator lists a live replica, a failed download is
retried and never replaced by an older checkpoint (I2).

In DiLoCo mode (:meth:`StageSync.sync_anchor`) the state the replicas share, report and serve is the one
after their last outer sync (the anchor), so that is what the rule above checks; a joiner then trains on
from the open step. It takes only the anchor the open step's outer round started from: while the stage's
replicas are still in the outer round before it (they serve the anchor from before), it waits for its
result, so a joiner syncs at an outer boundary and never trains a round from a stale anchor.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import trio
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.node.errors import SelfTestError, StateSyncError
from protolearn.node.persistence import StagePersistence
from protolearn.node.progress import Progress
from protolearn.node.state_sync import Fetched, fetch_state, fetch_state_split
from protolearn.node.worker import StageWorker
from protolearn.precision import allowance
from protolearn.protocol.boundary import distance
from protolearn.protocol.coordination import HASH_HISTORY
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.transport import Host

log = logging.getLogger("protolearn.node")
# A failed state download is retried this often while the stage has live replicas.
SYNC_RETRY_S = 1.0
# A downloaded state whose step the replicas have not reported yet is checked again this often, this many times.
CHECK_POLL_S = 0.1
CHECK_POLLS = 30
# A self-test result agrees within this many times the run's check_tolerance (no codec is involved).
SELF_TEST_TOLERANCE_FACTOR = 10.0

Verdict = Literal["ok", "wait", "refuse"]


def judge_state(applied: int, got: str, reported: Sequence[tuple[str, int, str]], *, frontier: int, init_hash: str) -> tuple[Verdict, str]:
    """Whether a state after ``applied`` steps that hashes to ``got`` is the stage's (see the module docstring).

    ``reported``: (replica, step, hash) of the stage's other serving replicas, each after its last few
    steps; ``frontier``: the coordinator's first uncommitted step. ``wait``: it cannot be told yet
    (ask again); ``refuse``: it is not.
    """
    if applied > max(frontier, 0):
        return "refuse", f"it claims {applied} applied steps, beyond the coordinator's frontier {frontier}"
    if applied == 0:
        if got == init_hash:
            return "ok", "the run's deterministic init"
        return "refuse", f"it claims 0 steps but hashes to {got[:12]}, not the run's deterministic init {init_hash[:12]}"
    step = applied - 1
    by_peer: dict[str, dict[int, str]] = {}
    for peer, s, h in reported:
        if h:
            by_peer.setdefault(peer, {})[s] = h
    latest = sorted(max(hs) for hs in by_peer.values())
    median = latest[(len(latest) - 1) // 2] if latest else step
    if median - step >= HASH_HISTORY:
        return "refuse", f"it is after step {step}, {median - step} steps older than most replicas' (after step {median})"
    # Every reporting replica votes; one whose reports do not hold the step (still behind it, or its
    # history starts after it) counts as not agreeing, and the next download is of a newer step.
    votes = Counter(hs[step] for hs in by_peer.values() if step in hs)
    if not votes:
        return "wait", f"no replica reported step {step} yet"
    ((best, count),) = votes.most_common(1)
    if 2 * count <= len(by_peer):
        return "wait", f"{count} of {len(by_peer)} replicas reported the same hash for step {step}, no majority"
    if best != got:
        return "refuse", f"it hashes to {got[:12]}, but the majority of replicas reported {best[:12]} for step {step}"
    return "ok", f"the majority of replicas reported {got[:12]} for step {step}"


def _self_test_distance(mine: torch.Tensor, raw: bytes) -> float:
    """Relative L2 distance of a donor's raw float32 self-test output from this node's (inf: malformed or not finite)."""
    if len(raw) != 4 * mine.numel():
        return math.inf
    theirs = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(mine.shape)
    return distance(mine, theirs) if bool(torch.isfinite(theirs).all()) else math.inf


class StageSync:
    """Syncs one built stage; the node makes one per build."""

    def __init__(
        self, config: NodeConfig, host: Host, link: CoordinatorLink, worker: StageWorker, persistence: StagePersistence,
        compute: trio.CapacityLimiter, progress: Progress, *, stage: int, run_hash: str, donors: Callable[[], list[str]],
        say_waiting: Callable[[str], None], clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.config = config
        self.host = host
        self.link = link
        self.worker = worker
        self.persistence = persistence
        self.compute = compute
        self.progress = progress
        self.stage = stage
        self.run_hash = run_hash
        self.donors = donors
        self.say_waiting = say_waiting
        self.clock = clock
        # The hash of the deterministic init, taken before anything is installed (the state after 0 steps).
        self._init_hash: str | None = None
        # The claims (applied, hash) judged in this sync: (why not, or "" where the stage's; when). A claim found
        # the stage's stays so; any other verdict serves the shares of the same download (each asks, one judge at a
        # time under the lock) for SYNC_RETRY_S, and a later attempt asks again: the reports may have caught up.
        self._judged: dict[tuple[int, str], tuple[str, float]] = {}
        self._judging = trio.Lock()

    async def sync(self, open_step: int) -> int:
        """Take the stage's state from a live replica, or keep the deterministic init on a fresh run.

        The installed state must hash to what the donor claims and be the stage's by the rule in the
        module docstring. While the coordinator lists a live replica, a
        failed download is retried (the list is refreshed by the heartbeats: a dead replica drops out
        when it expires) and never replaced by an older checkpoint, which would make this replica
        diverge from its stage (I2). Only a stage with no live replica left restores a checkpoint.
        """
        deadline = self.clock() + self.config.sync_timeout_s
        tried, last, planned_for = 0, "", None
        self._judged.clear()
        if self._init_hash is None:  # the worker is as built: the run seed's init
            self._init_hash = await trio.to_thread.run_sync(self.worker.state_hash, limiter=self.compute)
        while True:
            donors = self.donors()
            # A local or given checkpoint, the init, or (None) a download: see node/persistence.py.
            if donors != planned_for:
                planned_for = donors
                restored = await self.persistence.restore(
                    self.stage, self.worker, open_step if not tried else self.link.step, donors, self._reported,
                )
                if restored is not None:
                    if self.worker.run.integrity.self_test:
                        self.progress.say(f"self-test skipped: stage {self.stage}'s state came from {'the init' if restored == 0 else 'a checkpoint'}, with no donor's result to compare with")
                        self.progress.event("self_test", result="skipped")
                    return restored
            # Nothing to compare a download with yet: ask again rather than download what cannot be checked.
            waiting = await self._no_checks() if donors else ""
            if waiting:
                last = waiting
                donors = []
            # Several replicas each send a share (a hivemind newcomer loads everything from one); if
            # that fails, or they disagree, one replica at a time sends everything.
            attempts = [donors] if len(donors) > 1 else []
            for source in attempts + [[d] for d in donors]:
                tried += 1
                self_tests: dict[str, bytes] = {}
                try:
                    if len(source) > 1:
                        fetched = await fetch_state_split(
                            self.host, source, self.worker, self.run_hash, timeout_s=self.config.sync_timeout_s, self_tests=self_tests,
                            check=self._judge_claim,
                        )
                    else:
                        fetched = await fetch_state(
                            self.host, source[0], self.worker, self.run_hash, timeout_s=self.config.sync_timeout_s, self_tests=self_tests,
                            check=self._judge_claim,
                        )
                    await self._install(fetched)
                except (ProtocolError, StateSyncError) as err:
                    last = str(err)
                    log.warning("state sync failed donors=%s reason=%s", source, last)
                    continue
                await self._self_test(self_tests)
                return fetched.applied
            if self.clock() > deadline:
                raise StateSyncError(
                    f"could not sync stage {self.stage} from its replicas within {self.config.sync_timeout_s:g} s "
                    f"({tried} attempts, last: {last}); restart the node to try again"
                )
            if waiting:
                self.say_waiting(f"syncing stage {self.stage}: waiting for its replicas' parameter hashes ({waiting})")
            else:
                self.say_waiting(f"syncing stage {self.stage}: no replica handed over its state yet" if donors else "")
            await trio.sleep(SYNC_RETRY_S)

    async def sync_anchor(self, open_step: int) -> tuple[int, int]:
        """DiLoCo: take the stage's state after its last outer sync (a donor's, a checkpoint's or the init); returns
        (the steps that state is after, the step this replica trains next). See the module docstring. A stage with
        no live replica continues from its checkpoint, as in step mode."""
        deadline = self.clock() + self.config.sync_timeout_s
        h, steps = self.worker.run.sync.inner_steps, self.worker.run.steps
        while True:
            got = await self.sync(open_step)
            frontier = max(self.link.step, got)
            needed = min(h * (frontier // h), steps)  # the sync that started the open step's outer round
            if got >= needed or not self.donors():
                break
            if self.clock() > deadline:
                raise StateSyncError(f"stage {self.stage}'s replicas did not finish the outer sync after step {needed - 1} "
                                     f"within {self.config.sync_timeout_s:g} s; restart the node to try again")
            self.say_waiting(f"syncing stage {self.stage}: its replicas are in the outer sync after step {needed - 1}")
            await trio.sleep(SYNC_RETRY_S)
            open_step = self.link.step
        self.say_waiting("")
        if got == 0:  # the init (or a donor's state after no sync) is the anchor
            await trio.to_thread.run_sync(self.worker.take_anchor, limiter=self.compute)
        return got, frontier

    async def _no_checks(self) -> str:
        """Why no download could be checked now (empty: one may be). Before the first commit the init is
        the check; after it, nothing can be checked until some replica reported a hash."""
        if self.link.step <= 0 or await self._reported_list():
            return ""
        return "no replica reported one yet" if self.link.step > 0 else ""

    async def _judge_claim(self, donor: str, applied: int, claimed: str) -> None:
        """Refuse ``donor``'s claim, a state after ``applied`` steps that hashes to ``claimed``, before a tensor of
        it is taken, unless it is the stage's by the rule in the module docstring (raises StateSyncError). The
        download then checks each tensor against the digests that add up to ``claimed``."""
        claim = (applied, claimed)
        async with self._judging:
            why, when = self._judged.get(claim, ("?", -math.inf))
            if why and self.clock() - when >= SYNC_RETRY_S:
                for poll in range(CHECK_POLLS):
                    reported = await self._reported()  # also refreshes the frontier (link.step)
                    verdict, why = judge_state(applied, claimed, reported, frontier=self.link.step, init_hash=self._init_hash or "")
                    if verdict == "ok":
                        why = ""
                        break
                    if verdict == "refuse":
                        break
                    if poll < CHECK_POLLS - 1:  # the donors' own reports of this step may be a heartbeat behind their state
                        await trio.sleep(CHECK_POLL_S)
                self._judged[claim] = (why, self.clock())
        if why:
            raise StateSyncError(f"state from {donor} refused before its download: {why}")

    async def _install(self, fetched: Fetched) -> None:
        """Install downloaded state, whose claim :meth:`_judge_claim` found the stage's and whose tensors matched
        their digests, if it hashes to that claim once installed (no tensor outside the claim came with it); else
        raise, and the caller tries again. A refused state was loaded into the worker, and the next download replaces it."""
        applied, claimed, entries, donors = fetched
        got = await trio.to_thread.run_sync(self.worker.load, entries, limiter=self.compute)
        if got != claimed:
            raise StateSyncError(f"state from {donors} hashes to {got[:12]}, they claimed {claimed[:12]}")
        self.progress.event("synced", donor=donors[0], donors=donors, applied=applied, hash=got)
        who = ", ".join(d[-8:] for d in donors)
        self.progress.say(f"stage {self.stage}: took the state after {applied} steps from replica{'s' if len(donors) > 1 else ''} {who} (hash {got[:12]})")

    async def _self_test(self, outputs: dict[str, bytes]) -> None:
        """Known-answer self-test: this device's output on the run's self-test input must match what the donors
        computed with the state just installed, or, where most donors disagree with it, what this node's CPU
        computes with that state in float32: the donors' word alone never stops a node (one lying donor could
        otherwise send away every honest joiner it serves). Raises :class:`SelfTestError` when the device
        disagrees with that reference."""
        if not self.worker.run.integrity.self_test:
            return
        if not outputs:
            self.progress.say(f"self-test skipped: no replica of stage {self.stage} sent its result to compare with")
            self.progress.event("self_test", result="skipped")
            return
        mine = await trio.to_thread.run_sync(self.worker.self_test, limiter=self.compute)
        cfg = self.worker.run.integrity
        tol = SELF_TEST_TOLERANCE_FACTOR * cfg.check_tolerance + allowance(tuple(cfg.precisions))
        far = {donor: d for donor, raw in outputs.items() if not (d := _self_test_distance(mine, raw)) <= tol}  # NaN is far too
        if 2 * len(far) < len(outputs):
            for donor, d in far.items():
                log.warning("self-test: donor %s sent a result %.3g away from this node's and its other donors'", donor, d)
            self.progress.event("self_test", result="passed", donors=len(outputs))
            return
        reference = await trio.to_thread.run_sync(self.worker.self_test_reference, limiter=self.compute)
        worst = distance(mine, reference) if bool(torch.isfinite(mine).all()) else math.inf
        if worst <= tol:
            who = ", ".join(sorted(far))
            log.warning("self-test: donors %s sent results away from this node's, which its CPU computes the same with the "
                        "installed state (a faulty or lying donor)", who)
            self.progress.event("self_test", result="passed", donors=len(outputs), refereed=True, far_donors=sorted(far))
            return
        self.progress.event("self_test", result="failed", error=worst, donors=len(outputs))
        raise SelfTestError(
            f"self-test failed: this device computes stage {self.stage} {worst:.3g} (relative L2) away from its replicas "
            f"and from this machine's CPU (tolerance {tol:.3g}), so its GPU, driver or torch build is faulty; fix it, or "
            f"join with --device cpu"
        )

    async def reported_hashes(self, step: int) -> dict[str, str]:
        """The parameter hashes this stage's other replicas reported for ``step`` (empty if unknown)."""
        if step < 0:
            return {}
        return {p: h for p, s, h in await self._reported() if s == step}

    async def _reported_list(self) -> list[tuple[int, str]]:
        return [(s, h) for _, s, h in await self._reported()]

    async def _reported(self) -> list[tuple[str, int, str]]:
        """(replica, step, parameter hash) after the last few steps this stage's other replicas applied,
        as they reported them (empty if unknown)."""
        try:
            reported = await self.link.stage_hashes(self.stage)
        except ProtocolError as err:
            log.info("stage hashes request failed reason=%s", err.reason)
            return []
        return [(ph.peer_id, ph.step, ph.hash) for ph in reported if ph.hash and ph.peer_id != self.host.peer_id]
