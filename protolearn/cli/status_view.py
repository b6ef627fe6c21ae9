"""How ``swarm status`` (and the demo's live view) draws the swarm: readable at 80 columns.

:func:`render` returns one rich renderable: a header (run, coordinator, uptime), the verdict, the
progress (``step N of total``, tokens/s and an ETA), the loss as a chart with its scale, then the stages
and the nodes. The nodes table is compact on a terminal narrower than :data:`WIDE_COLUMNS`, one line
per node that fits 80 columns: name, stage, state, step, throughput and one health word
(:func:`health`). A wider terminal, or ``wide=True`` (``--wide``), gets everything else too (peer ID,
last seen, queue, integrity, spot checks, reachability, path, flags).

In DiLoCo mode (the run's ``sync``) the header names the mode and H, a stage's ``synced@step`` is the step
of its replicas' last outer sync (their shared state), a table shows each stage's last outer round (round,
the step it synced after, its quorum, who took part and who was left out, and why), and a node's ``step``
is its inner step (``--wide`` adds the step of its last outer sync).

The loss chart covers the whole history it was given, averaged into at most :data:`CHART_WIDTH` bars on
one fixed scale that is printed beside it (``▁`` = the lowest loss, ``█`` = the highest), so a falling
loss reads as a falling line rather than as noise rescaled to the last few steps.
"""

from __future__ import annotations

from typing import Any

from protolearn.protocol import status_schema as ss

SPARKS = "▁▂▃▄▅▆▇█"
CHART_WIDTH = 32
# From this many columns the nodes table shows every column (it fits in this width).
WIDE_COLUMNS = 150
VERDICT_STYLE = {
    "healthy": "bold green", "at risk": "bold yellow", "degraded": "bold yellow", "halted": "bold white on red", "finished": "bold cyan",
}


def short(peer_id: str) -> str:
    return f"…{peer_id[-8:]}" if len(peer_id) > 10 else peer_id


def label(n: ss.NodeView) -> str:
    """A node's name as the tables show it: its --name, with its peer ID's tail when names repeat or there is none."""
    return n.name or short(n.peer_id)


def chart(values: list[float], width: int = CHART_WIDTH) -> str:
    """``values`` averaged into at most ``width`` bars, scaled from their minimum (▁) to their maximum (█)."""
    if not values:
        return ""
    buckets = min(width, len(values))
    bars = [values[len(values) * i // buckets : len(values) * (i + 1) // buckets] for i in range(buckets)]
    means = [sum(b) / len(b) for b in bars]
    lo, hi = min(means), max(means)
    span = hi - lo
    top = len(SPARKS) - 1
    return "".join(SPARKS[0 if span <= 0 else min(top, int((m - lo) / span * top + 0.5))] for m in means)


def sparkline(values: list[float], width: int = 40) -> str:
    """The last ``width`` values as a sparkline on their own scale (kept for callers of the old view)."""
    return chart(values[-width:], width)


def duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def health(n: ss.NodeView) -> str:
    """One word for a node's standing, the most urgent first (its flags say the rest, with --wide)."""
    flags = n.flags
    if "stale" in flags:
        return "stale"
    if "hash-mismatch" in flags:
        return "mismatch"
    if n.probation == "failed":
        return "failed"
    if any(":" in f for f in flags):  # the verdict policy's conduct flags, kind:strikes
        return "flagged"
    if "behind" in flags:
        return "behind"
    if n.probation == "probation":
        return "probation"
    if "no-throughput" in flags:
        return "starting"
    return "ok"


def verdict_word(st: ss.Status) -> str:
    return "at risk" if st.verdict == "healthy" and st.at_risk else st.verdict


def _integrity(n: ss.NodeView) -> str:
    """A node's monitor score and probation state, as its checkers report them ("-" when none checks it)."""
    if n.integrity is None:
        return "-"
    return f"{n.integrity:.2f} {n.probation}".strip()


def _progress(st: ss.Status) -> str:
    total = st.run.steps
    done = st.last_committed + 1
    step = f"step {done} of {total}" if total else f"step {done}"
    if st.last_closed < 0:
        step += " (none closed yet)"
    elif st.last_committed < st.last_closed:
        step += f" (step {st.last_closed} closed, its stages average it)"
    out = f"{step} · {st.tokens_per_s:,.0f} tokens/s"
    if st.eta_s is not None:
        out += f" · ETA {duration(st.eta_s)}"
    return out


def _loss(st: ss.Status) -> Any:
    from rich.text import Text

    text = Text("loss ")
    if st.loss is None:
        text.append("-")
        return text
    text.append(f"{st.loss:.4f}", style="bold")
    values = [p.loss for p in st.loss_history]
    if len(values) >= 2:
        text.append("  ")
        text.append(chart(values), style="cyan")
        first, last = st.loss_history[0].step, st.loss_history[-1].step
        text.append(f"  ▁={min(values):.2f} █={max(values):.2f}, steps {first}-{last}")
    return text


def _outer(st: ss.Status) -> Any:
    """DiLoCo: each stage's last outer round (round, the step it synced after, its quorum, who took part and
    who was left out), or None when no stage has had one."""
    from rich import box
    from rich.table import Table

    if not any(s.outer for s in st.stages):
        return None
    names = {n.peer_id: label(n) for n in st.nodes}
    table = Table(title="outer rounds", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("stage", "round", "after", "quorum", "in"):
        table.add_column(col, no_wrap=True)
    table.add_column("left out", overflow="fold")
    for s in st.stages:
        o = s.outer
        if o is None:
            continue
        took = f"{len(o.participants)}" + (f"+{len(o.followers)} following" if o.followers else "")
        out = ", ".join(f"{names.get(x.peer_id, short(x.peer_id))} ({x.reason.split(':')[0]})" for x in o.left_out) or "-"
        table.add_row(str(s.index), f"{o.round}" + (f" try {o.attempt}" if o.attempt > 1 else ""), f"step {o.step}", str(o.quorum), took, out,
                      style="yellow" if o.left_out else "")
    return table


def _stages(st: ss.Status) -> Any:
    from rich import box
    from rich.table import Table

    diloco = st.run.sync == "diloco"
    table = Table(title="stages", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("stage", "layers", "replicas", "tok/s", "synced@step" if diloco else "params@step", "hashes"):
        table.add_column(col, no_wrap=True)
    for s in st.stages:
        if s.replicas == 0 and st.verdict == "finished":
            table.add_row(str(s.index), str(s.layers), "0", "0", "-", "done: its nodes left")
            continue
        if s.replicas == 0:
            table.add_row(str(s.index), str(s.layers), "0", "0", "-", "NO REPLICA: HALTED", style="bold white on red")
            continue
        if s.param_step < 0:
            hashes = "-"
        else:
            hashes = "agree" if s.hashes_agree else "DISAGREE"
        replicas = f"{s.replicas} (at risk)" if s.index in st.at_risk else str(s.replicas)
        table.add_row(
            str(s.index), str(s.layers), replicas, f"{s.throughput:,.0f}", str(s.param_step) if s.param_step >= 0 else "-", hashes,
            style="" if s.hashes_agree else "yellow",
        )
    return table


def _nodes(st: ss.Status, wide: bool) -> Any:
    from rich import box
    from rich.table import Table

    diloco = st.run.sync == "diloco"
    table = Table(title="nodes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ["name", "stage", "state", "step", "tok/s", "health"]
    if wide:
        cols = ["name", "peer", "stage", "state", "step", *(["synced"] if diloco else []), "tok/s", "last seen", "queue", "integrity",
                "checks", "reach", "path", "flags"]
    for col in cols:
        # Compact: every cell fits 80 columns on one line. Wide on a narrow terminal: cells wrap, never cut.
        table.add_column(col, no_wrap=not wide, overflow="fold" if wide else "ellipsis")
    names = [label(n) for n in st.nodes]
    for n, name in zip(st.nodes, names, strict=True):
        if names.count(name) > 1 and n.name:
            name = f"{n.name} {short(n.peer_id)}"  # two nodes with one name: tell them apart
        style = "yellow" if n.flags or n.probation == "failed" else ""
        shown = n.inner_step if diloco else n.step  # DiLoCo: its inner step; n.step is then its last outer sync's
        step = str(shown) if shown >= 0 else "-"
        if not wide:
            table.add_row(name, str(n.stage), n.state, step, f"{n.throughput:,.0f}", health(n), style=style)
            continue
        checks = f"{n.checks_passed}/{n.checks_failed}" + (f" ev:{n.evidence}" if n.evidence else "")
        synced = ([str(n.step) if n.step >= 0 else "-"] if diloco else [])
        table.add_row(
            n.name or "-", short(n.peer_id), str(n.stage), n.state, step, *synced, f"{n.throughput:,.0f}", f"{n.last_seen_s:.1f}s",
            str(n.queue_len), _integrity(n), checks, n.reachability, n.path or "-", ",".join(n.flags) or "-", style=style,
        )
    return table


class StatusView:
    """The status as rich draws it; the nodes table is wide or compact by the width it is drawn in."""

    def __init__(self, st: ss.Status, wide: bool | None = None) -> None:
        self.st = st
        self.wide = wide

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        st = self.st
        head = Text()
        head.append(f"run {st.run.name}", style="bold")
        mode = f" · DiLoCo H={st.run.inner_steps}" if st.run.sync == "diloco" else ""
        head.append(f" · {st.run.num_stages} stages · B={st.run.microbatches_per_step}{mode} · coordinator {short(st.coordinator)} · up {duration(st.uptime_s)}")
        yield head
        word = verdict_word(st)
        verdict = Text(word.upper(), style=VERDICT_STYLE.get(word, "bold"))
        reason = st.verdict_reason
        if word == "at risk":
            which = ", ".join(map(str, st.at_risk))
            many = len(st.at_risk) > 1
            reason = f"stage{'s' if many else ''} {which} ha{'ve' if many else 's'} a single replica: losing it halts training"
        verdict.append(f"  {reason}", style="")
        yield verdict
        yield Text(_progress(st))
        yield _loss(st)
        yield _stages(st)
        outer = _outer(st)
        if outer is not None:
            yield outer
        if st.nodes:
            yield _nodes(st, self.wide if self.wide is not None else options.max_width >= WIDE_COLUMNS)
        if st.bans:
            from rich import box

            bans = Table(title="banned", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
            bans.add_column("peer", no_wrap=True)
            bans.add_column("reason", overflow="fold")
            for b in st.bans:
                bans.add_row(short(b.peer_id), b.reason)
            yield bans


def render(st: ss.Status, *, wide: bool | None = None) -> StatusView:
    """A rich renderable of the status (see the module docstring); ``wide`` None: by the terminal's width."""
    return StatusView(st, wide)
