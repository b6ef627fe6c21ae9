"""The report's sections for the suites that came before the home links (their tables were in the README).

Each ``render_*`` takes the suite's stored result and returns the section's markdown (tables from the
JSON the suite printed, and a figure where one helps); see ``scripts/bench_report.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("protolearn_report_format", Path(__file__).with_name("report_format.py"))
assert _spec is not None and _spec.loader is not None
fmt = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fmt
_spec.loader.exec_module(fmt)
table, num, dec, get, bars = fmt.table, fmt.num, fmt.dec, fmt.get, fmt.bars


def render_reference(r: dict[str, Any], figs: Path, plt: Any) -> str:
    out = [table(["run", "params", "stages", "threads", "tokens/s", "s/step", "last loss"], [[
        r.get("run"), num(r.get("params")), r.get("num_stages"), r.get("threads"), num(r.get("tokens_per_s")), num(r.get("s_per_step")),
        dec(r.get("last_loss"), 3)]])]
    if plt is not None:
        out += ["", bars(plt, figs / "reference.png", [f"{r.get('run')}, {r.get('threads')} threads"], {"tokens/s": [r.get("tokens_per_s")]},
                         ylabel="tokens/s", title="the single-process trainer")]
    return "\n".join(out)


def render_swarm(r: dict[str, Any], figs: Path, plt: Any) -> str:
    out = [
        f"A local swarm ({r.get('stages')} stages × 1 replica, {r.get('threads_per_node')} thread each, codec none) against the "
        f"reference trainer ({r.get('reference_threads')} threads, before and after) on the same run; goal `ratio` ≥ 0.90.",
        "",
        table(["swarm tokens/s", "reference tokens/s (before, after)", "`ratio`", "swarm s/step", "averaging s/step (mean)", "last loss"], [[
            num(r.get("swarm_tokens_per_s")), f"{num(r.get('reference_tokens_per_s'))} ({', '.join(num(x) for x in r.get('reference_tokens_per_s_before_after', []))})",
            f"**{dec(r.get('ratio'), 3)}**", num(r.get("swarm_s_per_step")), num(r.get("averaging_s_mean")), dec(r.get("swarm_last_loss"), 3)]]),
    ]
    if plt is not None:
        out += ["", bars(plt, figs / "swarm.png", ["reference", "swarm"], {"tokens/s": [r.get("reference_tokens_per_s"), r.get("swarm_tokens_per_s")]},
                         ylabel="tokens/s", title="swarm vs reference trainer")]
    return "\n".join(out)


def render_transport(r: dict[str, Any], figs: Path, plt: Any) -> str:
    out = [
        "4 MiB tensor frames on a libp2p stream vs raw bytes on a bare py-libp2p stream, and the same frames over the bulk lane, "
        "between two processes; a request round trip on a new stream.",
        "",
        table(["framed stream MiB/s", "raw stream MiB/s", "`ratio`", "bulk lane MiB/s", "`bulk_vs_stream`", "request round trip ms"], [[
            num(r.get("frame_mib_s")), num(r.get("raw_mib_s")), dec(r.get("ratio"), 3), num(r.get("bulk_mib_s")), dec(r.get("bulk_vs_stream"), 3),
            num(r.get("request_ms_median"))]]),
    ]
    codecs = r.get("codecs")
    if codecs:
        out += ["", "Codec speed on a (1024, 4096) float32 activation (`scripts/bench_codecs.py`, part of this suite):", "",
                table(["codec", "encode MiB/s", "decode MiB/s", "wire / raw bytes", "relative error"], [
                    [f"`{c}`", num(get(v, "encode_mib_s")), num(get(v, "decode_mib_s")), dec(get(v, "ratio"), 3), num(get(v, "rel_error"), 2)]
                    for c, v in codecs.items()])]
    if plt is not None:
        out += ["", bars(plt, figs / "transport.png", ["raw stream", "framed stream", "bulk lane"],
                         {"MiB/s": [r.get("raw_mib_s"), r.get("frame_mib_s"), r.get("bulk_mib_s")]}, ylabel="MiB/s", title="one transfer path each")]
    return "\n".join(out)


def render_recovery(r: dict[str, Any], figs: Path, plt: Any) -> str:
    rows = [
        ["all-reduce, no fault (`allreduce_s`)", num(r.get("allreduce_s")), f"{r.get('clean_lane_parts')} of {r.get('clean_parts')} parts on the lane"],
        ["all-reduce, a peer SIGKILLed mid-scatter", num(r.get("allreduce_with_failure_s")),
         f"`ratio_failure` {dec(r.get('ratio_failure'), 3)} (goal < 3); survivors identical: {num(r.get('failure_identical'))}"],
        ["hivemind `DecentralizedAverager`, same size", num(r.get("hivemind_allreduce_s")),
         f"`ratio_vs_hivemind` {dec(r.get('ratio_vs_hivemind'), 3)} (goal ≤ 0.5)" if r.get("ratio_vs_hivemind") else (r.get("hivemind_error") or "not run (`--no-hivemind`)")],
        ["swarm: a replica SIGKILLed → steps at speed (`recover_s`)", num(r.get("recover_s")), f"goal ≤ max(1 s, one step: {num(r.get('s_per_step_before_kill'))} s)"],
        ["the same by the measure before 2026-12-06 (`recover_first_close_s`)", num(r.get("recover_first_close_s")),
         "to the first step first seen closed after the kill that itself took ≤ 1.5 steps"],
        ["restarted replica: join → first microbatch", num(r.get("join_to_first_microbatch_s")), f"goal ≤ 3 s; {num(r.get('start_to_first_microbatch_s'))} s from process start"],
    ]
    out = [f"Our fault-tolerant all-reduce of {r.get('mib')} MiB over {r.get('peers')} processes, then a local swarm on the demo run.", "",
           table(["what", "seconds", "notes"], rows)]
    if plt is not None:
        labels = ["all-reduce", "with failure", "hivemind", "recover_s", "join→1st mb"]
        vals = [r.get("allreduce_s"), r.get("allreduce_with_failure_s"), r.get("hivemind_allreduce_s"), r.get("recover_s"), r.get("join_to_first_microbatch_s")]
        out += ["", bars(plt, figs / "recovery.png", labels, {"seconds": vals}, ylabel="seconds", title="all-reduce and recovery")]
    return "\n".join(out)


def render_hivemind(r: dict[str, Any], figs: Path, plt: Any) -> str:
    rows = [[label, num(get(f, "seconds")), num(get(f, "completed")), num(get(f, "identical")), ", ".join(map(str, get(f, "hung", default=[]))) or "–"]
            for label, f in r.get("hivemind_failures", {}).items()]
    out = [
        f"hivemind {r.get('hivemind')} `DecentralizedAverager`, {r.get('mb')} MB over {r.get('peers')} loopback peers: "
        f"{num(r.get('hivemind_allreduce_s'))} s per all-reduce (rounds {r.get('hivemind_allreduce_rounds_s')}); then peer "
        f"{r.get('killed_peer')} SIGKILLed mid-round:", "",
        table(["timeouts", "seconds", "completed", "survivors identical", "hung"], rows)]
    failures = r.get("hivemind_failures", {})
    if plt is not None:
        out += ["", bars(plt, figs / "hivemind.png", ["no fault", *failures], {"seconds": [r.get("hivemind_allreduce_s"), *(get(f, "seconds") for f in failures.values())]},
                         ylabel="seconds", title="hivemind's all-reduce, and with a peer SIGKILLed")]
    return "\n".join(out)


def render_restart(r: dict[str, Any], figs: Path, plt: Any) -> str:
    out = [table(["clients", "restarts", "reconnect median s", "reconnect max s", "goal", "within goal"], [[
        r.get("clients"), r.get("restarts"), num(r.get("reconnect_median_s")), num(r.get("reconnect_max_s")), f"≤ {r.get('goal_reconnect_s')} s",
        num(r.get("within_goal"))]])]
    if plt is not None and r.get("reconnect_s"):
        labels = [f"restart {i + 1}" for i in range(len(r["reconnect_s"]))]
        series = {f"client {c}": [per[c] if c < len(per) else None for per in r["reconnect_s"]] for c in range(r.get("clients", 0))}
        out += ["", bars(plt, figs / "restart.png", labels, series, ylabel="seconds", title="coordinator restart: each client's reconnect")]
    return "\n".join(out)


def render_coordinator(r: dict[str, Any], figs: Path, plt: Any) -> str:
    sizes = r.get("sizes", [])
    keys = [("heartbeat_ms", "heartbeat ms"), ("join_ms", "join ms"), ("lease_ms", "lease ms"), ("status_ms", "status ms"),
            ("join_reply_bytes", "join reply bytes"), ("view_reply_bytes", "changed view, snapshot bytes"), ("view_delta_bytes", "changed view, delta bytes")]
    rows = [[label] + [num(r.get(f"{k}_{n}")) for n in sizes] for k, label in keys]
    out = [f"`CoordinatorCore.handle` (no network), {r.get('stages')} stages, every heartbeat a training/averaging flip. "
           f"`heartbeat_growth` {dec(r.get('heartbeat_growth'), 3)} (goal ≤ 2, and ≤ 0.3 ms at 10,000).", "",
           table(["members"] + [num(n) for n in sizes], rows)]
    if plt is not None and sizes:
        out += ["", bars(plt, figs / "coordinator.png", [num(n) for n in sizes],
                         {label: [r.get(f"{k}_{n}") for n in sizes] for k, label in keys[:4]}, ylabel="ms per request", title="request paths vs members", log=True)]
    return "\n".join(out)


def render_abuse(r: dict[str, Any], figs: Path, plt: Any) -> str:
    attacks = r.get("attacks", {})
    stream = {n: a for n, a in attacks.items() if "outcome" not in a}
    member = {n: a for n, a in attacks.items() if "outcome" in a}

    def timing(a: dict[str, Any]) -> list[str]:
        before = " / ".join(num(v) for v in a.get("baseline_ms", {}).values())
        during = " / ".join(num(v) for v in a.get("honest_ms", {}).values())
        return [", ".join(a.get("honest_ms", {})), f"{before} → {during}", num(a.get("latency_ratio")), num(a.get("mem_growth_bytes"))]

    rows = []
    for name, a in stream.items():
        refused = sum(v for k, v in a.items() if isinstance(v, int) and k.endswith("_rejected"))
        bans = sum(v for k, v in a.items() if isinstance(v, int) and k.endswith("_temp_bans"))
        rows.append([f"`{name}`", *timing(a), f"{refused} / {bans}", num(a.get("honest_ok"))])
    out = [f"Each attack from this process against a target process while an honest peer works; honest latency in ms without → with "
           f"the attack; `mem_growth_bytes` is the target's RSS growth. Background heartbeats missed: {r.get('background_heartbeats_missed')}; "
           f"all honest ok: {num(r.get('all_honest_ok'))}.", ""]
    if rows:
        out += ["**Stream attacks** (a coordinator and a stage's collective as the target):", "",
                table(["attack", "honest ops", "ms without → with", "`latency_ratio`", "`mem_growth_bytes`", "refused / temp bans", "`honest_ok`"], rows), ""]
    if member:
        out += ["**Member attacks** (issue 27: members that joined normally and lie with messages they can sign, against a coordinator and "
                "an honest swarm of four replicas, two per stage, that run the node's decision core and collective; the honest operation is "
                "one training step, `honest_ok` also needs every step applied with each ticket once, identical replicas and no strike or ban on "
                "an honest replica):", "",
                table(["attack", "honest ops", "ms without → with", "`latency_ratio`", "`mem_growth_bytes`", "outcome", "`honest_ok`"],
                      [[f"`{name}`", *timing(a), a["outcome"], num(a.get("honest_ok"))] for name, a in member.items()])]
    if plt is not None and attacks:
        names = list(attacks)
        out += ["", bars(plt, figs / "abuse.png", [n.replace("_", "\n") for n in names], {"latency_ratio": [attacks[n].get("latency_ratio") for n in names]},
                         ylabel="honest latency, with ÷ without", title="attacks", hline=1.0)]
    return "\n".join(out)


def render_framing(r: dict[str, Any], figs: Path, plt: Any) -> str:
    rows, labels = [], []
    for x in r.get("layouts", []):
        label = f"{x['sybils']} of {x['replicas']}"
        labels.append(label)
        rows.append([label, num(x.get("tickets")), num(x.get("all_sybil_draws")), num(x.get("framed")), dec(x.get("expected_framed"), 2),
                     f"{num(x.get('chosen_refused'))} of {num(x.get('chosen_attempts'))}"])
    out = ["A Sybil reporter attacks an honest replica on every ticket it received, with the real coordinator core and real keys: it asks "
           "for the check's witnesses and files the Sybils' made-up outputs whenever the draw is all theirs (`framed`; the expectation is "
           "tickets × `framing_chance`), and every 50th ticket it files evidence with two Sybil witnesses it chose itself (the rule before "
           f"the draw, which framed on every try). A minority never framed (stages up to 16): {num(r.get('minority_never_framed'))}; "
           f"chosen witnesses always refused: {num(r.get('chosen_witnesses_refused'))}; seed {r.get('seed')}.", "",
           table(["Sybils of the stage", "tickets", "all-Sybil draws", "`framed`", "`expected_framed`", "chosen witnesses refused"], rows)]
    if plt is not None and rows:
        per = [x.get("tickets") or 1 for x in r["layouts"]]
        out += ["", bars(plt, figs / "framing.png", labels, {
            "framed per 10⁵ tickets": [1e5 * x.get("framed", 0) / t for x, t in zip(r["layouts"], per, strict=True)],
            "expected per 10⁵ tickets": [1e5 * x.get("expected_framed", 0) / t for x, t in zip(r["layouts"], per, strict=True)],
        }, ylabel="convictions of the honest replica", title="framing with drawn witnesses")]
    return "\n".join(out)


def render_integrity(r: dict[str, Any], figs: Path, plt: Any) -> str:
    rows = []
    for kind, k in r.get("kinds", {}).items():
        reason = next(iter(k.get("bans", {}).values()), "") if isinstance(k.get("bans"), dict) else ""
        loss = k.get("loss_ratio") if kind not in ("blackhole", "hang") else None
        if kind == "blackhole":
            effect = f"tokens/s after the ban: {dec(k.get('throughput_ratio_after_ban'), 3)} × honest"
        elif kind == "hang":  # its own watchdog leaves; the coordinator waits on it for no step
            # (results before 2026-12-06 counted the steps over 3 x the honest median; later ones also over it plus the late window)
            over = f"{dec(k.get('slow_step_s'), 2)} s" if k.get("slow_step_s") is not None else "3 ×"
            effect = (f"left out after {dec(k.get('left_out_after_s'), 1)} s; step time {dec(k.get('step_time_ratio'), 2)} × honest, "
                      f"{num(k.get('slow_steps'))} step(s) over {over} (longest {dec(k.get('max_step_s'), 2)} s)")
            reason = k.get("hung_error") or ""
        else:
            effect = dec(loss, 3) if loss is not None else "–"
        rows.append([kind, num(k.get("detected")), num(k.get("microbatches_to_ban")), num(k.get("false_positives")), effect,
                     f"`{reason[:90]}`" if reason else "–"])
    runs = r.get("honest_runs", [])
    steps = (r.get("honest") or {}).get("steps_closed") or 30
    sync = r.get("sync", "step")
    mode = "" if sync == "step" else (f", in DiLoCo mode with {sync.split(':')[1]} inner steps between outer syncs (spot checks of the first "
                                      "inner step after each sync only)")
    out = [f"Every adversary kind in a real local swarm (2 + 2 honest nodes, a {steps}-step 2-stage run{mode}; the adversary joins as a newcomer). "
           f"Honest runs: {len(runs)}, banning {r.get('false_positives', {}).get('honest', '–')} nodes; final losses "
           f"{', '.join(dec(h.get('final_loss'), 3) for h in runs)}.", "",
           table(["kind", "banned", "microbatches to ban", "honest nodes banned", "final loss / honest run's", "the ban reason starts"], rows)]
    if r.get("overhead"):
        o = r["overhead"]
        out += ["", f"Overhead of the checks (off vs on, alternating): {fmt.pct(o.get('overhead'))} "
                f"(off {o.get('tokens_per_s_off')}, on {o.get('tokens_per_s_on')} tokens/s over {o.get('steps')} steps)."]
    if plt is not None and rows:
        kinds = list(r["kinds"])
        fig = "integrity.png" if sync == "step" else "integrity-diloco.png"
        out += ["", bars(plt, figs / fig, kinds, {"microbatches to ban": [r["kinds"][k].get("microbatches_to_ban") for k in kinds]},
                         ylabel="count", title="corrupted microbatches (leases for the blackhole) before the ban")]
    return "\n".join(out)


def render_compression(r: dict[str, Any], figs: Path, plt: Any) -> str:
    out = [f"At equal tokens ({r.get('steps')} steps, seeds {r.get('seeds')}), every codec passed through the boundary codec in "
           f"`train-local`; {num(r.get('seconds'))} s. The full tables and the plot: [compression.md](compression.md). Per model, the "
           "headline codec (the best at a ratio of 64 or more):", ""]
    rows = []
    for model, m in r.get("models", {}).items():
        rows.append([model, m.get("d_model"), num(m.get("params")), m.get("headline"), dec(m.get("ratio"), 3), dec(m.get("loss_subspace"), 4),
                     dec(m.get("loss_none"), 4), fmt.pct(m.get("loss_rel_diff")), num(get(r, "goal_met", model))])
    out += [table(["model", "D", "params", "headline codec", "ratio", "final val loss", "`none`'s", "vs none", "goal met"], rows), "",
            "![compression](compression.png)"]
    return "\n".join(out)


def render_nat(r: dict[str, Any], figs: Path, plt: Any) -> str:
    punched = r.get("path_after") == "hole-punched"
    rows = [
        ["relayed (through the relay in \"public\")", f"reservation {num(r.get('reserve_ms'))} ms, circuit dial {num(r.get('circuit_dial_ms'))} ms", num(r.get("relayed_mib_s"))],
        ["hole-punched" if punched else "after the punch attempt (still relayed)", f"punch {num(r.get('punch_s'))} s after the circuit opened" if punched else "no punch",
         f"{num(r.get('second_mib_s'))}" + (f" ({num(r.get('punched_vs_relayed'))}× relayed)" if punched else "")],
        ["direct, B dials a public host through its NAT", r.get("direct_path", ""), num(r.get("direct_mib_s"))],
    ]
    out = [f"Real NATs in network namespaces (`random_fully` {num(r.get('random_fully'))}: "
           f"{'port-randomising routers' if r.get('random_fully') else 'routers keep source ports'}); B sends {r.get('mib')} MiB in 4 MiB tensors per path.", "",
           table(["path", "set-up", "MiB/s"], rows)]
    if plt is not None:
        name = "nat-random.png" if r.get("random_fully") else "nat.png"
        out += ["", bars(plt, figs / name, ["relayed", "second stream", "direct"], {"MiB/s": [r.get("relayed_mib_s"), r.get("second_mib_s"), r.get("direct_mib_s")]},
                         ylabel="MiB/s", title="paths through NATs")]
    return "\n".join(out)


def render_coordinator_net(r: dict[str, Any], figs: Path, plt: Any) -> str:
    levels = r.get("levels", [])
    out = [
        f"A `coordinator start` subprocess on 127.0.0.1 with its default settings, loaded by {r.get('workers')} load-generator "
        "processes (`scripts/coordinator_load.py`) on the same 2 cores: every member is its own libp2p client (its own key, Noise "
        "connection and `CoordinatorLink`), joins, is placed in a stage, and heartbeats at the interval the coordinator sets "
        "(it grows with the swarm, `coordinator/core/pacing.py`). Per level, after one interval of settling, a window "
        "of at least 1.2 intervals: client-side heartbeat round trips, the coordinator's CPU (`/proc/<pid>/stat`) and RSS over its "
        f"RSS before the first join ({num(r.get('coordinator_base_rss_mb'))} MB), and the load generators' CPU. "
        f"**`members_sustained` {num(r.get('members_sustained'))}** (goal ≥ {num(r.get('goal_members'))}): the largest level where "
        "every member stayed and p99 < 1 s. Seed " + str(r.get("seed")) + ".",
        "",
        table(["members", "interval s", "heartbeats/s", "p50 ms", "p99 ms", "max ms", "coordinator CPU (cores)", "CPU ms / member / s",
               "CPU ms / heartbeat", "RSS MB", "RSS KB / member", "clients' CPU (cores)", "join p50 / p99 ms", "ramp CPU ms / join",
               "expired / failed", "sustained"],
              [[num(lv.get("members")), num(lv.get("interval_s")), num(lv.get("heartbeats_per_s")), num(lv.get("p50_ms")), num(lv.get("p99_ms")),
                num(lv.get("max_ms")), dec(lv.get("coordinator_cpu_cores"), 3), dec(lv.get("cpu_ms_per_member_s"), 3),
                dec(lv.get("cpu_ms_per_heartbeat"), 2), num(lv.get("coordinator_rss_mb")), num(lv.get("rss_kb_per_member")),
                dec(lv.get("clients_cpu_cores"), 3), f"{num(lv.get('join_p50_ms'))} / {num(lv.get('join_p99_ms'))}",
                num(lv.get("ramp_cpu_ms_per_join")), f"{lv.get('expired')} / {sum((lv.get('failures') or {}).values())}",
                "yes" if lv.get("sustained") else "**no**"] for lv in levels]),
    ]
    if plt is not None and levels:
        xs = [lv["members"] for lv in levels]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(xs, [lv["p99_ms"] for lv in levels], "o-", color="tab:red", label="p99 heartbeat round trip (ms)")
        ax.axhline(1000, color="tab:red", linestyle=":", linewidth=1)
        ax.set_xlabel("members")
        ax.set_ylabel("p99 heartbeat round trip, ms", color="tab:red")
        ax2 = ax.twinx()
        ax2.plot(xs, [100 * lv["coordinator_cpu_cores"] for lv in levels], "s-", color="tab:blue", label="coordinator CPU, % of a core")
        ax2.plot(xs, [100 * lv["clients_cpu_cores"] for lv in levels], "^--", color="tab:gray", label="load generators' CPU, % of a core")
        ax2.set_ylabel("CPU, % of one core")
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
        ax.set_title("coordinator over the network: python scripts/bench.py coordinator-net --json", fontsize=9)
        out += ["", fmt.save(fig, figs / "coordinator-net.png")]
    out += fmt.notes(figs, "coordinator-net")
    return "\n".join(out)


def render_simcurves(r: dict[str, Any], figs: Path, plt: Any) -> str:
    points = r.get("points", [])
    base = r.get("base", {})
    out = [
        f"`scripts/simulate.py`'s built-in scenario (a 7B-class model on consumer GPUs behind home links, `protolearn/sim/default.toml`), "
        f"{num(r.get('hours'))} simulated hours a point, seed {r.get('seed')}. Each curve varies one thing from the base point "
        f"({num(base.get('nodes'))} nodes, {base.get('stages')} stages, a {base.get('mean_lifetime')} mean lifetime). `goodput` is the share "
        "of the swarm's work (compute, averaging, state downloads) that ended up in a committed step; `busy` the share of node-time "
        "that is work at all (the rest is pipeline bubbles and waits on links). Each point's command is in the stored result.",
        "",
        table(["curve", "value", "goodput", "tokens/s", "step s", "busy", "lost: state downloads", "lost: redone compute", "wall s"],
              [[pt["axis"], str(pt["value"]), "timed out" if pt.get("timed_out") else dec(pt.get("goodput"), 3),
                num(pt.get("tokens_per_s")), num(pt.get("step_s")), dec(pt.get("busy_share"), 3),
                dec(get(pt, "lost", "state_downloads"), 3), dec(get(pt, "lost", "redone_or_dropped_compute"), 3), num(pt.get("wall_s"))]
               for pt in points]),
    ]
    axes = [a for a in ("nodes", "mean_lifetime", "stages") if any(pt["axis"] == a for pt in points)]
    if plt is not None and axes:
        fig, panels = plt.subplots(1, len(axes), figsize=(4 * len(axes), 3.4), squeeze=False)
        for ax, axis in zip(panels[0], axes):
            pts = [pt for pt in points if pt["axis"] == axis and not pt.get("timed_out")]
            labels = [str(pt["value"]) for pt in pts]
            ax.plot(labels, [pt["goodput"] for pt in pts], "o-", color="tab:blue", label="goodput")
            ax.axhline(0.95, color="tab:blue", linestyle=":", linewidth=1)
            ax.set_ylim(0, 1)
            ax.set_xlabel(axis.replace("_", " "))
            ax.set_ylabel("goodput", color="tab:blue")
            ax2 = ax.twinx()
            ax2.plot(labels, [pt["tokens_per_s"] for pt in pts], "s--", color="tab:orange", label="tokens/s")
            ax2.set_ylabel("tokens/s", color="tab:orange")
            ax2.set_ylim(bottom=0)
        fig.suptitle("python scripts/bench.py simcurves --json", fontsize=9)
        out += ["", fmt.save(fig, figs / "simcurves.png")]
    out += fmt.notes(figs, "simcurves")
    return "\n".join(out)


def render_simcheck(r: dict[str, Any], figs: Path, plt: Any) -> str:
    real, sim, ratio = r.get("real", {}), r.get("sim", {}), r.get("sim_over_real", {})
    within = r.get("within_20pct", {})
    rows = [
        ["step time (s, median between closes)", num(real.get("step_s")), num(sim.get("step_s")), dec(ratio.get("step_s"), 2), within.get("step_s")],
        ["goodput", dec(real.get("goodput"), 3), dec(sim.get("goodput"), 3), dec(ratio.get("goodput"), 2), within.get("goodput")],
        ["bytes sent per committed token", num(real.get("bytes_per_token")), num(sim.get("bytes_per_token")), dec(ratio.get("bytes_per_token"), 2),
         within.get("bytes_per_token")],
        ["tokens/s", num(real.get("tokens_per_s")), num(sim.get("tokens_per_s")), dec(ratio.get("tokens_per_s"), 2), "–"],
    ]
    out = [
        f"The same small scenario in both: {r.get('nodes')} nodes, {r.get('stages')} stages of the demo run, every node on "
        f"`{r.get('link')}`, {r.get('steps')} steps; a replica (stage {r.get('victim_stage')}) SIGKILLed after {r.get('crash_after')} steps and "
        f"a fresh node joining after {r.get('join_after')}. The simulation replays the real run's joins and crash on their clock, at the "
        f"compute speed the real nodes measured ({dec(real.get('calibrated_tflops'), 4)} TFLOPS each: six processes share two cores). "
        "Its command is in the stored result.",
        "",
        table(["figure", "real swarm", "simulator", "sim ÷ real", "within 20%"], [[*row[:4], {True: "yes", False: "**no**"}.get(row[4], row[4])] for row in rows]),
    ]
    if plt is not None and real and sim:
        labels = ["step s", "goodput × 10", "kB/token"]
        out += ["", bars(plt, figs / "simcheck.png", labels, {
            "real swarm": [real.get("step_s"), 10 * (real.get("goodput") or 0), (real.get("bytes_per_token") or 0) / 1000],
            "simulator": [sim.get("step_s"), 10 * (sim.get("goodput") or 0), (sim.get("bytes_per_token") or 0) / 1000],
        }, ylabel="value", title="python scripts/bench.py simcheck --json")]
    out += fmt.notes(figs, "simcheck")
    return "\n".join(out)
