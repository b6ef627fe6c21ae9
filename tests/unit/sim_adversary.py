"""A Byzantine member for :mod:`node_sim`: it joined normally and may send any message it can sign (issue 27, item 10).

An :class:`Adversary` is a node of the simulated swarm that the coordinator placed like any other. It runs
the node core (so it takes part in the pipeline and the collective), always reports a made-up result hash
(``Sim.liars``), and at each of its seeded events sends the real coordinator core one more message its
identity can sign, with any values: heartbeat claims (any stage, state, step, hash, checks), redos of any
tickets, liveness and integrity reports against honest members (claims, or evidence its colluders signed),
witness draws, forged result hashes, completions with acks it signs itself, leases it never uses, releases,
and leaving and rejoining. Scripted strategies weight the draw toward one attack for a whole schedule: the
named attacks of the issue (a redo storm, liveness bans by bare words, a claimed stage, stage steering by
rejoining, framing with colluding witnesses), withholding (it takes activations and never answers) and
breaking rounds (as a participant it fails its stage's round for every other replica, which then name it as
the cause, as the real collective does; its redos name any causes it likes).

Colluders (several adversaries of one schedule) aim at the same honest target and sign for each other.
"""

from __future__ import annotations

import random

from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.boundary import OutputEvidence, SignedOutput

from tests.unit.node_sim import Sim, SimNode, Unavailable, _sim_sign

STRATEGIES = ("random", "redo_storm", "liveness_words", "claim_stage", "rejoin_steering", "frame", "withhold", "forged_acks", "break_rounds")
ACTIONS = ("heartbeat", "redo", "liveness", "report", "integrity_claim", "frame", "draw", "averaged", "complete", "lease", "release", "rejoin")
FAVOURITE = {"redo_storm": "redo", "liveness_words": "liveness", "claim_stage": "heartbeat", "rejoin_steering": "rejoin", "frame": "frame",
             "forged_acks": "complete"}
EVENT_S = (0.05, 0.4)  # the adversary acts this often (uniform)


class Adversary:
    """The agents of one schedule: every adversary node acts on its own seeded clock."""

    def __init__(self, sim: Sim, peers: list[str], strategy: str, rng: random.Random) -> None:
        self.sim = sim
        self.peers = peers
        self.strategy = strategy
        self.rng = rng
        self.sent: dict[str, int] = {}
        self.refused = 0
        sim.liars.update(peers)
        sim.adversaries.update(peers)
        honest = [n for n in sim.nodes.values() if n.peer not in peers]
        self.target = rng.choice(honest).peer  # the colluders' common victim
        for p in peers:
            if strategy == "withhold":
                sim.nodes[p].compute_hung = True  # it heartbeats and takes work, and never answers
            if strategy == "break_rounds":
                sim.round_breakers.add(p)  # it fails every round of its stage it takes part in
            sim.after(rng.uniform(*EVENT_S), lambda p=p: self._act(p))

    def _act(self, peer: str) -> None:
        node = self.sim.nodes[peer]
        if node.banned or not node.alive or node.moved:
            return
        fav = FAVOURITE.get(self.strategy)
        action = fav if fav is not None and self.rng.random() < 0.6 else self.rng.choice(ACTIONS)
        self.sent[action] = self.sent.get(action, 0) + 1
        try:
            getattr(self, f"_{action}")(node)
        except (Refusal, Unavailable):
            self.refused += 1
        self.sim.after(self.rng.uniform(*EVENT_S), lambda: self._act(peer))

    # -- what it can sign --------------------------------------------------------------------------
    def _victim(self) -> str:
        honest = [p for p, n in self.sim.nodes.items() if p not in self.peers and n.alive and not n.banned]
        return self.target if self.target in honest or not honest else self.rng.choice(honest)

    def _step(self) -> int:
        frontier = max(0, self.sim.coord.ledger.frontier) if self.sim.now >= self.sim.down_until else 0
        return max(0, frontier + self.rng.randint(-2, 1))

    def _tickets(self) -> list[int]:
        return sorted(self.rng.sample(range(self.sim.B), self.rng.randint(1, self.sim.B)))

    def _heartbeat(self, node: SimNode) -> None:
        honest_hashes = [cm.RecentHash(step=0, hash="h" * 64)]
        self.sim.request(node.peer, cm.Heartbeat(
            state=self.rng.choice(("training", "syncing", "averaging", "leaving")), step=self.rng.randint(-1, self.sim.steps),
            stage=self.rng.randrange(self.sim.S), param_hash=self.rng.choice(("", "f" * 64, f"forged-{node.peer}")),
            recent=honest_hashes if self.rng.random() < 0.3 else [],
            checks=[cm.PeerCheck(peer_id=self._victim(), score=1e6, state="failed", passed=0, failed=99)],
        ))

    def _redo(self, node: SimNode) -> None:
        kind = self.rng.choice(("", "round_failed", "replica_out", "lost_gradients", "orphaned"))
        causes = self.rng.sample(sorted(self.sim.nodes), self.rng.randint(0, 2)) if kind == "round_failed" else []
        self.sim.request(node.peer, cm.Redo(step=self._step(), indices=self._tickets(), reason="round failed", revision=self.rng.randint(0, 3),
                                            kind=kind, causes=causes))  # type: ignore[arg-type]

    def _liveness(self, node: SimNode) -> None:
        lost = self.rng.choice((0, 1, 3, 8, 2**31 - 1))
        self.sim.request(node.peer, cm.Report(target=self._victim(), reason=f"liveness: {lost} microbatches it acknowledged got no gradient back",
                                              lost=lost))

    def _report(self, node: SimNode) -> None:
        # Two "contradicting" statements, both signed by the reporter itself: never the accused's signature.
        data = f"claim|{self._step()}|{node.peer}".encode()
        ev = cm.StatementEvidence(data=data, signature=_sim_sign(node.peer, data))
        self.sim.request(node.peer, cm.Report(target=self._victim(), reason="equivocation", evidence=ev, conflicting=ev))

    def _integrity_claim(self, node: SimNode) -> None:
        self.sim.request(node.peer, cm.IntegrityReport(target=self._victim(), reason="spot check: far from a replica's"))

    def _draw(self, node: SimNode) -> list[str]:
        msg = cm.WitnessDraw(target=self._victim(), step=self._step(), ticket=self.rng.randrange(self.sim.B), direction=self.rng.choice(("fwd", "bwd")))
        reply = self.sim.request(node.peer, msg)
        assert isinstance(reply, cm.WitnessDrawReply)
        return reply.witnesses

    def _frame(self, node: SimNode) -> None:
        """Evidence against the victim whose witnesses are the colluders (drawn or not), signed by them."""
        victim = self._victim()
        drawn = self._draw(node)
        witnesses = drawn if drawn and set(drawn) <= set(self.peers) else [p for p in self.peers if p != victim][:2] or [node.peer]
        outputs = [SignedOutput(signer=w, signature=_sim_sign(w, b"made-up"), codec="none", dtype="float32", shape=[1], data=b"\0\0\0\0")
                   for w in witnesses]
        accused = SignedOutput(signer=victim, signature=b"\1" * 64, codec="none", dtype="float32", shape=[1], data=b"\0\0\x80\x3f")
        ev = OutputEvidence(accused=victim, step=self._step(), ticket=0, direction="fwd", stage=self.sim.nodes[victim].stage, inputs=b"",
                            outputs=[accused, *outputs][:9])
        self.sim.request(node.peer, cm.IntegrityReport(target=victim, reason="spot check", evidence=ev))

    def _averaged(self, node: SimNode) -> None:
        self.sim.request(node.peer, cm.Averaged(step=self._step(), revision=self.rng.randint(1, 3), result_hash=f"forged-{self.rng.randrange(3)}"))

    def _complete(self, node: SimNode) -> None:
        """Complete a ticket of the open step with a route and loss it made up, acked with its own signature."""
        step = self._step()
        ticket = self.rng.randrange(self.sim.B)
        route = [self.rng.choice(list(self.sim.nodes)) for _ in range(self.sim.S - 1)] + [node.peer]
        nonce = self.rng.randbytes(16)
        ack = _sim_sign(node.peer, ack_statement(self.sim.run.run_hash, step, ticket, route, 0.5, nonce))
        self.sim.request(node.peer, cm.Complete(step=step, index=ticket, route=route, loss=0.5, ack=ack, nonce=nonce))

    def _lease(self, node: SimNode) -> None:
        self.sim.request(node.peer, cm.Lease(max_tickets=self.rng.randint(1, self.sim.B)))  # and never completes them

    def _release(self, node: SimNode) -> None:
        self.sim.request(node.peer, cm.Release(step=self._step(), indices=self._tickets()))

    def _rejoin(self, node: SimNode) -> None:
        """Leave and join again, hoping to land elsewhere (the sim keeps it where it was placed first)."""
        self.sim.request(node.peer, cm.Leave(reason="brb"))
        reply = self.sim.request(node.peer, cm.Join(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=self.rng.choice((1.0, 100.0, 1e4))))
        assert isinstance(reply, cm.JoinReply)
        if reply.stage != node.stage:
            self.sim.move_out(node, f"rejoined at stage {reply.stage} (was {node.stage})")
