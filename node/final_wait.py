"""A node that finished the run stays until the coordinator has kept the final model.

When a run's last step commits, every node has finished and would leave at once, and with the last
replica of each stage the model would leave too (``swarm export`` found nothing to fetch). A coordinator
that keeps the final model says ``final="collecting"`` in its heartbeat replies until it has fetched
every stage; :func:`stay_for_final_model` keeps heartbeating (and the node's state server answering)
until it says ``saved``, or says nothing (an older coordinator, or one that gave up), or
:data:`FINAL_WAIT_S` passes, whichever comes first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from protolearn.node.coordinator_link import CoordinatorLink
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError

log = logging.getLogger("protolearn.node")

# The longest a finished node stays for the coordinator to fetch its stage.
FINAL_WAIT_S = 300.0


async def stay_for_final_model(
    link: CoordinatorLink, heartbeat: Callable[[], cm.Heartbeat], say: Callable[[str], None], *, every_s: float, wait_s: float = FINAL_WAIT_S,
) -> bool:
    """Heartbeat until the coordinator holds the final model; True if it said so."""
    told = False
    with trio.move_on_after(wait_s):
        while True:
            try:
                reply = await link.heartbeat(heartbeat())
            except ProtocolError as err:
                log.warning("final heartbeat failed: %s", err.reason)
                return False
            if reply.final != "collecting":
                return reply.final == "saved"
            if not told:
                told = True
                say("run finished; staying until the coordinator has saved the final model")
            await trio.sleep(every_s)
    say(f"the coordinator did not save the final model within {wait_s:g} s; leaving (this node's checkpoint holds its stage)")
    return False
