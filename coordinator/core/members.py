"""A member's record: who it is, the stage it holds, what its heartbeats last said, and how others see it.

A :class:`Member` is ``live`` (:data:`LIVE`) from its join until it leaves (:data:`LEFT`), expires
(:data:`EXPIRED`: no heartbeat for ``expiry_s``) or is banned (:data:`BANNED`); the registry
(``registry.py``) makes those changes. :class:`JoinInfo` and :class:`HeartbeatInfo` are what a join and a
heartbeat claim, before the registry bounds them; :class:`MemberDecision` is its answer.

A member *serves* its stage in the :data:`SERVING_STATES` (training or averaging): it counts as working,
routes and averages. Every member flips between those two each step and nobody routes differently
because of it, so that flip is not a change other nodes must see (:func:`shows_change`); what they see of a
member is :func:`view_entry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protolearn.protocol import coordination as cm
from protolearn.protocol.states import NodeState

LIVE = "live"
LEFT = "left"
EXPIRED = "expired"
BANNED = "banned"
# The node states in which a member serves its stage (counts as working, and routes and averages).
SERVING_STATES = frozenset(s for s in NodeState if s.live)
# Per-peer tables that are pruned lazily (the redo budget, the lease strikes) are pruned once they hold
# more than this many entries per member that may appear in them, plus this slack: amortised O(1).
_ENTRIES_PER_MEMBER = 2
_SLACK = 64


@dataclass
class Member:
    peer_id: str
    addrs: list[str]
    device: str
    memory_gb: float
    throughput: float
    stage: int
    joined_at: float
    last_seen: float
    name: str = ""
    status: str = LIVE
    state: NodeState = NodeState.SYNCING
    queue_len: int = 0
    step: int = -1
    param_hash: str = ""
    loss: float | None = None
    moved_at: float = 0.0
    left_at: float = 0.0
    move_reason: str = ""
    # The stage the node last said it serves (-1: not said). It lags ``stage`` while the node moves.
    serving: int = -1
    # When a state change of it last showed in the view (None: none since it joined); see view_state_interval_s.
    shown_at: float | None = None
    # The corpus fingerprint it reported (CorpusCheck); a vote while it is a live stage-0 member.
    corpus: str = ""
    # The coordinator's own reachability verdict on it (reachability.py), whether it offered to relay for
    # others, and how its stage peers reach it (its last heartbeat's word; "" until then).
    reachability: str = "unknown"
    relay: bool = False
    path: str = ""
    # The session of the process that joined as it ("": not said; protocol/bounds.py Session).
    session: str = ""
    # The IP address its join came from, as the coordinator saw it ("": unknown): address_cap.py.
    ip: str = ""
    # DiLoCo: the last inner step it applied, as its heartbeat says (-1: not said); ``step`` is its last outer sync's.
    inner_step: int = -1

    def __post_init__(self) -> None:
        self.state = NodeState(self.state)  # the store keeps it as its string value

    @property
    def serving_stage(self) -> int:
        """The stage it finishes work for now: the one it said it serves, else the one it holds (a replica
        moving to another stage still finishes the step of the stage it serves)."""
        return self.serving if self.serving >= 0 else self.stage

    @property
    def stages(self) -> set[int]:
        """The stages it holds or still serves (one, or two while it moves)."""
        return {self.stage, self.serving} - {-1}


@dataclass(frozen=True)
class JoinInfo:
    addrs: list[str]
    device: str = "cpu"
    memory_gb: float = 0.0
    throughput: float = 0.0
    name: str = ""
    # The coordinator's verdict (never the node's claim; "unknown" keeps a returning member's last one)
    # and the node's offer to relay.
    reachability: str = "unknown"
    relay: bool = False
    # The microbatches it lets in at once (0: not said): with memory_gb, which stages fit it (fit.py).
    max_in_flight: int = 0
    session: str = ""  # its process's session ("": not said)
    # The IP address its connection came from, as the coordinator's host saw it (None: unknown).
    ip: str | None = None

    @classmethod
    def of(cls, msg: cm.Join, reachability: str, ip: str | None = None) -> JoinInfo:
        """What ``msg`` claims, with the coordinator's own ``reachability`` verdict for the node's and the address it saw."""
        return cls(list(msg.addrs), msg.device, msg.memory_gb, msg.throughput, msg.name, reachability, msg.relay, msg.max_in_flight,
                   msg.session, ip)


@dataclass(frozen=True)
class HeartbeatInfo:
    state: NodeState
    throughput: float = 0.0
    queue_len: int = 0
    step: int = -1
    param_hash: str = ""
    loss: float | None = None
    stage: int = -1  # the stage the node serves now (-1: not said)
    # (step, hash) after its last few applied steps (protocol/coordination.py HASH_HISTORY), oldest first.
    recent: tuple[tuple[int, str], ...] = ()
    path: str = ""  # how its stage peers reach it ("": not said)
    addrs: tuple[str, ...] = ()  # where it is to be dialled now, if that changed since it joined (): unchanged)
    session: str = ""  # the session it joined with ("": not said)
    inner_step: int = -1  # DiLoCo: its last inner step (-1: not said)

    @classmethod
    def of(cls, msg: cm.Heartbeat) -> HeartbeatInfo:
        return cls(
            msg.state, msg.throughput, msg.queue_len, msg.step, msg.param_hash, msg.loss, msg.stage, tuple((r.step, r.hash) for r in msg.recent),
            msg.path, tuple(msg.addrs), msg.session, msg.inner_step,
        )


@dataclass(frozen=True)
class MemberDecision:
    accepted: bool
    code: str
    reason: str
    stage: int = -1
    rejoined: bool = False


def shows_change(a: NodeState, b: NodeState) -> bool:
    """Whether a change from state ``a`` to ``b`` is one other nodes must see (not training ↔ averaging)."""
    return a != b and not (a in SERVING_STATES and b in SERVING_STATES)


def view_entry(m: Member) -> cm.MemberView:
    """``m`` as other nodes see it: enough to route to it and average with it."""
    return cm.MemberView(
        peer_id=m.peer_id, stage=m.stage, addrs=list(m.addrs), state=m.state, throughput=float(m.throughput), queue_len=m.queue_len
    )


def outgrows(entries: int, members: int) -> bool:
    """Whether a lazily pruned per-peer table of ``entries`` outgrew the ``members`` that may appear in it."""
    return entries > _ENTRIES_PER_MEMBER * members + _SLACK
