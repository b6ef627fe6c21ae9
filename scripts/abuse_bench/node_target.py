"""The stream attacks' target process: a coordinator and one stage's collective, as a node serves them.

``python -m abuse_bench.node_target DATA_DIR NUMEL`` (the bench starts it: :mod:`.harness`). It runs a
coordinator service (:func:`protolearn.coordinator.service.serve`, default transport limits) and a stage-1
node host with the collective handler (an :class:`~protolearn.node.averaging.Averager` that knows its
stage's two members) plus a tensor ``sink`` protocol that takes any peer's tensor (as the activation lane
does), and a second member host to average with. Commands (one JSON line each): ``member`` (the honest
peer is a member of the stage in the node's view), ``stats`` (what the two gates refused, and their
temporary bans), ``next`` (the node's next round), ``round`` (a real 2-member round: its time and whether
both members hold the exact sum), ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import trio

from abuse_bench.harness import SEED

STAGE = 1


async def serve_target(data_dir: str, numel: int) -> None:
    import torch

    from protolearn.coordinator.service import serve
    from protolearn.node.averaging import Averager
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.pipeline import Ack
    from protolearn.protocol.rounds import round_id
    from protolearn.protocol.tensors import from_frame
    from protolearn.protocol.transport import FramedStream, open_host
    from protolearn.stages.config import default_run

    async def sink(peer: str, s: FramedStream) -> None:
        frame = await s.receive_tensor(codec="none", dtype=torch.float32)
        from_frame(frame, peer=peer, dtype=torch.float32, require_finite=True)
        await s.send(Ack())

    asked = {"id": 0}

    def say(obj: dict) -> None:  # the answer to the last command (its id, for the bench's Target)
        sys.stdout.write(json.dumps({**obj, "id": asked["id"]}) + "\n")
        sys.stdout.flush()

    async with trio.open_nursery() as nursery:
        coord = await nursery.start(lambda task_status: serve(default_run(), data_dir, task_status=task_status))
        async with open_host(Identity.generate()) as node, open_host(Identity.generate()) as member:
            members = {node.peer_id, member.peer_id}
            # Rounds are numbered as a node numbers them (one step apart), so only the last few results are kept.
            upcoming = [round_id(1)]
            avgs = [Averager(h, STAGE, numel, timeout_s=20.0, members=lambda: members, window=lambda: upcoming[0]) for h in (node, member)]
            for a in avgs:
                a.register()
            node.add_peer_addrs(member.peer_id, member.addrs())
            member.add_peer_addrs(node.peer_id, node.addrs())
            node.serve_stream("sink", sink)
            say({"coord": coord.addrs[0], "node": node.addrs()[0], "node_id": node.peer_id, "pid": os.getpid()})
            weights = {node.peer_id: 1.0, member.peer_id: 1.0}
            gen = torch.Generator().manual_seed(SEED)
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                cmd = json.loads(line or '{"cmd": "stop"}')
                asked["id"] = cmd.get("id", 0)
                if cmd["cmd"] == "stop":
                    break
                if cmd["cmd"] == "member":  # the honest peer is a member of the stage in the node's view
                    members.add(cmd["peer"])
                    say({"members": len(members)})
                    continue
                if cmd["cmd"] == "stats":  # what the two gates refused, and how many temporary bans they gave
                    gates = {"node": node.gate, "coordinator": coord.host.gate}
                    say({k: {"rejected": sum(g.rejected.values()), "temp_bans": g.abuse.num_bans} for k, g in gates.items()})
                    continue
                if cmd["cmd"] == "next":
                    say({"next": avgs[0].next_round})
                    continue
                vectors = [torch.randn(numel, generator=gen) for _ in avgs]
                r = upcoming[0]
                out: dict[int, torch.Tensor] = {}
                t0 = trio.current_time()
                try:
                    with trio.fail_after(30):
                        async with trio.open_nursery() as rounds:
                            for k, a in enumerate(avgs):
                                async def one(k: int = k, a: Averager = a) -> None:
                                    out[k] = await a.run_round(r, weights, vectors[k])
                                rounds.start_soon(one)
                    ok = torch.equal(out[0], out[1]) and torch.allclose(out[0], vectors[0] + vectors[1])
                except Exception as err:  # the bench reports it as a failed honest round
                    print(f"round {r} failed: {type(err).__name__}: {err}", file=sys.stderr)
                    ok = False
                upcoming[0] = r + round_id(1)
                say({"s": trio.current_time() - t0, "ok": ok, "next": upcoming[0]})
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(serve_target, sys.argv[1], int(sys.argv[2]))
