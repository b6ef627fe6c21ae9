"""When a replica tells the coordinator that a next-stage peer lost its microbatches, and what the count means.

A replica that handed a microbatch to a peer of the next stage and got no gradient back within its deadline
restarts it elsewhere and reports the peer (``coord.report`` with reason ``liveness: ...`` and ``lost``, the
losses in a row). Both sides read the same constants here, so the rule has one owner:

- the **first** loss is reported at once: a *notice*. The coordinator charges the reporter's own late leases
  to the peer that sat on its tickets (costs go to their cause), while its own record agrees (nothing routed
  through that peer completed since), and does nothing more with it;
- after that, at most once per :data:`REPORT_INTERVAL_S`, except that reaching :data:`REPORT_AFTER_LOST`
  losses in a row is reported at once: only such a report flags the peer and counts toward a liveness ban
  (which needs a strict majority of the stage before it, and the coordinator's record, besides);
- a peer that leaves the swarm (or whose connection closes) while it holds handed microbatches is sent a
  notice with ``lost`` 0: the replica's router forgets a departed peer's losses, so a peer that leaves and
  rejoins with them would otherwise never be named as their cause.

Standard library only: the node core and the coordinator core both import it.
"""

from __future__ import annotations

# Losses in a row that make a report count toward a ban (and flag its target); fewer make a notice.
REPORT_AFTER_LOST = 3
# A peer is reported at most this often (reaching REPORT_AFTER_LOST aside): a coordinator counts a report
# this much older than a holder's late lease as still about it.
REPORT_INTERVAL_S = 5.0


def should_report(lost: int, last: tuple[float, int] | None, now: float) -> bool:
    """Whether a peer that lost ``lost`` handed microbatches in a row is reported now; ``last``: (when, count)
    of the previous report of it (see the module docstring)."""
    if lost < 1:
        return False
    if last is None:
        return True
    at, count = last
    return now - at >= REPORT_INTERVAL_S or (count < REPORT_AFTER_LOST <= lost)


def should_notice_departure(last: tuple[float, int] | None, now: float) -> bool:
    """Whether a peer that left (or whose connection closed) holding handed microbatches is sent a departure
    notice now; ``last``: (when, count) of the previous report of it. At most once per :data:`REPORT_INTERVAL_S`."""
    return last is None or now - last[0] >= REPORT_INTERVAL_S
