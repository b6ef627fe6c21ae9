"""Bench suite ``report``: run the benchmark suites and write ``docs/BENCHMARKS.md`` from their stored results.

``python scripts/bench.py report [--json] [--only NAME,...] [--render-only] [--quick] [--docs DIR] [--list]``

Each section of the report is one suite invocation (:data:`SECTIONS`: the suite, its arguments, and how
to render it). Running a section runs ``python scripts/bench.py SUITE --json ARGS`` in a subprocess and
stores what it printed, with the command, the commit, the time it took and the machine's load average
before and after, in ``docs/bench/<name>.json``. The markdown is always rendered from the stored
results, all of them, so one section can be re-run alone (``--only links,internet``) and
``--render-only`` rewrites the document and its figures (``docs/bench/*.png``, matplotlib) without
running anything. A plain ``report`` runs every section marked ``default``; the others (too long for
every report, like ``compression``'s 40 minutes) keep their stored result until named in ``--only``.
A section that cannot run here (``nat`` needs root and iptables, ``hivemind`` its own venv) is
skipped with the reason, and its last stored result, if any, is rendered under a note saying so. A
suite that fails keeps its previous result, and the document says the last run failed and why.

``--json`` prints ``internet_efficiency`` (P11, the best codec's) and what became of each section.
``--quick`` runs the sections' short variants into ``--docs`` (default here: a temporary folder, so
the stored full results are not overwritten).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SUITE_TIMEOUT_S = 4 * 3600


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"protolearn_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _root_and(*tools: str) -> Callable[[], str | None]:
    def why() -> str | None:
        if os.geteuid() != 0:
            return "needs root (it builds network namespaces)"
        missing = [t for t in tools if not any((Path(d) / t).exists() for d in os.environ.get("PATH", "").split(os.pathsep))]
        return f"needs {', '.join(missing)} on PATH" if missing else None

    return why


def _hivemind_venv() -> str | None:
    return None if (ROOT / ".bench-venv" / "bin" / "python").exists() else (
        "needs hivemind 1.1.12 in .bench-venv/ (bench.py hivemind installs it; not installed here, so its last stored result stands)")


@dataclass(frozen=True)
class Section:
    name: str  # its stored result: docs/bench/<name>.json
    suite: str
    args: tuple[str, ...]
    title: str
    render: str  # "module:function" of a renderer
    part: str  # "links": the home-link sections; "suites": those moved from the README
    default: bool = True  # run by a plain `report`
    quick: tuple[str, ...] | None = None  # the short variant's arguments (None: the section is left out of --quick)
    needs: Callable[[], str | None] | None = None
    store: str | None = None  # a result kept elsewhere (relative to the repo), instead of docs/bench/<name>.json
    anchor: str | None = None  # the section's anchor before the report existed, which other documents still link to
    timeout_s: float = SUITE_TIMEOUT_S  # how long its suite may run


SECTIONS: tuple[Section, ...] = (
    Section("links", "links", (), "The link model's fidelity", "report_links:render_links", "links", quick=("--quick",)),
    Section("internet", "internet", (), "P11: the swarm on home links ÷ on loopback", "report_links:render_p11", "links", quick=("--quick",)),
    Section("internet", "internet", (), "Where a step's time goes", "report_links:render_breakdown", "links", quick=("--quick",)),
    Section("pipeline", "pipeline", (), "Pipeline efficiency", "report_links:render_pipeline", "links", quick=("--quick",)),
    Section("linkrecovery", "linkrecovery", (), "Join and recovery on home links", "report_links:render_linkrecovery", "links",
            quick=("--steps", "10", "--warmup", "3")),
    # Only the mode that can send 100x fewer bytes (32 inner steps x int8's 4x) against the loopback baseline, resumable in
    # .bench/sync: about 45 minutes per seed here (all eight modes: about 5 h per seed; run those by hand with --modes).
    Section("sync", "sync", ("--workdir", ".bench/sync", "--modes", "diloco32-int8"), "Replica sync modes on home links",
            "report_links:render_sync", "links", default=False,
            quick=("--quick",), timeout_s=14 * 3600),
    Section("reference", "reference", (), "Reference trainer", "report_suites:render_reference", "suites", quick=("--steps", "3", "--warmup", "1"), anchor="reference-the-single-process-trainer"),
    Section("swarm", "swarm", (), "Local swarm vs reference", "report_suites:render_swarm", "suites", quick=("--steps", "3", "--warmup", "1"), anchor="swarm-pipeline-throughput-against-the-reference"),
    Section("transport", "transport", (), "Transport: stream, bulk lane, codecs", "report_suites:render_transport", "suites",
            quick=("--rounds", "1", "--frames", "4"), anchor="transport-tensor-frames-and-the-bulk-lane"),
    Section("recovery", "recovery", ("--no-hivemind",), "Fault-tolerant all-reduce and swarm recovery", "report_suites:render_recovery", "suites",
            quick=("--no-hivemind", "--mib", "8", "--no-swarm"), anchor="recovery-the-all-reduce-and-a-replica-restart"),
    Section("hivemind", "hivemind", (), "hivemind's averager, for comparison", "report_suites:render_hivemind", "suites", needs=_hivemind_venv, anchor="hivemind-the-baseline-all-reduce"),
    Section("restart", "restart", (), "Coordinator restarts", "report_suites:render_restart", "suites", quick=("--restarts", "1"), anchor="restart-a-coordinator-killed-and-restarted"),
    Section("coordinator", "coordinator", (), "Coordinator request paths at scale", "report_suites:render_coordinator", "suites",
            quick=("--sizes", "100,1000", "--repeat", "1"), anchor="coordinator-request-paths-as-the-swarm-grows"),
    Section("coordinator-net", "coordinator-net", (), "Coordinator over the network", "report_suites:render_coordinator_net", "suites",
            default=False, quick=("--levels", "40", "--workers", "2", "--window", "3")),
    Section("simcurves", "simcurves", (), "The simulated swarm at scale: goodput against size, lifetime and stages", "report_suites:render_simcurves",
            "suites", default=False, quick=("--quick",), timeout_s=3 * 3600),
    Section("simcheck", "simcheck", (), "The simulator against a real swarm", "report_suites:render_simcheck", "suites", default=False,
            quick=("--steps", "12", "--crash-after", "4", "--join-after", "8")),
    Section("abuse", "abuse", (), "Network attacks on a coordinator, a node and a swarm", "report_suites:render_abuse", "suites", quick=("--quick",), anchor="abuse-network-attacks-on-a-running-coordinator-and-node"),
    Section("framing", "framing", ("--tickets", "200000"), "Framing an honest replica: the coordinator's witness draw", "report_suites:render_framing", "suites",
            quick=("--tickets", "500"), anchor="framing-an-honest-replica-the-coordinators-witness-draw"),
    Section("integrity", "integrity", ("--no-overhead",), "Integrity: every adversary kind", "report_suites:render_integrity", "suites",
            quick=("--kinds", "signflip", "--steps", "12", "--no-overhead"), anchor="integrity-each-adversary-kind-in-a-real-swarm"),
    Section("integrity-diloco", "integrity", ("--no-overhead", "--diloco", "4", "--steps", "50", "--honest-seeds", "5"),
            "Integrity in DiLoCo mode: every adversary kind", "report_suites:render_integrity", "suites", default=False),
    Section("compression", "compression", ("--plot", "docs/compression.png"), "Boundary compression against loss", "report_suites:render_compression",
            "suites", default=False, store="docs/compression.json", anchor="compression-bytes-per-token-against-loss"),
    Section("nat", "nat", (), "Paths through real NATs", "report_suites:render_nat", "suites", quick=("--mib", "4"), needs=_root_and("ip", "iptables"), anchor="nat-paths-through-real-nats"),
    Section("nat-random", "nat", ("--random-fully",), "Paths through port-randomising NATs", "report_suites:render_nat", "suites",
            quick=("--random-fully", "--mib", "4"), needs=_root_and("ip", "iptables")),
)


def _stored_path(s: Section, docs: Path) -> Path:
    return ROOT / s.store if s.store and docs == DOCS else docs / "bench" / f"{s.name}.json"


def _command(s: Section, quick: bool) -> list[str]:
    return ["python", "scripts/bench.py", s.suite, "--json", *(s.quick if quick and s.quick is not None else s.args)]


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def run_section(s: Section, docs: Path, quick: bool) -> str:
    """Run ``s``'s suite and store its result; returns what happened (for ``--json``)."""
    path = _stored_path(s, docs)
    why = s.needs() if s.needs is not None else None
    if why is not None:
        _note(path, s, skipped=why)
        return f"skipped: {why}"
    argv = _command(s, quick)
    load0, t0 = os.getloadavg(), time.time()
    print(f"report: running {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=s.timeout_s)
    seconds, load1 = time.time() - t0, os.getloadavg()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        _note(path, s, failed=f"exit {proc.returncode}: {tail}")
        return f"failed: {tail}"
    result = json.loads(lines[-1])
    meta = {"command": " ".join(argv), "commit": _git_commit(), "finished": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
            "seconds": round(seconds, 1), "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in load1],
            "cpus": os.cpu_count()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if s.store and path == ROOT / s.store:
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (docs / "bench").mkdir(parents=True, exist_ok=True)
        (docs / "bench" / f"{s.name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    else:
        path.write_text(json.dumps({"meta": meta, "result": result}, indent=1) + "\n", encoding="utf-8")
    return "ran"


def _note(path: Path, s: Section, **note: str) -> None:
    """Mark a stored result as skipped or failed this time (the result itself stays)."""
    stored = _read(path, s) or {"meta": {}, "result": None}
    if s.store and path == ROOT / s.store:
        return
    stored["meta"] = {**stored.get("meta", {}), "last_attempt": {**note, "at": time.strftime("%Y-%m-%d %H:%M", time.localtime())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1) + "\n", encoding="utf-8")


def _read(path: Path, s: Section) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if s.store and path == ROOT / s.store:  # the suite's own output, its meta next to the report's results
        meta_path = path.parent / "bench" / f"{s.name}.meta.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.exists() else {"command": " ".join(_command(s, False))}
        return {"meta": meta, "result": data}
    return data


def render(docs: Path, *, figures: bool = True) -> str:
    """Write ``docs/BENCHMARKS.md`` (and the figures) from the stored results; returns the markdown."""
    fmt = _load("report_format")
    plt = fmt.pyplot() if figures else None
    if figures and plt is None:
        raise SystemExit("error: the report's figures need matplotlib: .venv/bin/python -m pip install -e '.[bench]' (or pass --no-figures)")
    renderers = {m: _load(m) for m in ("report_links", "report_suites")}
    figs = docs / "bench"
    stored = {s.name: _read(_stored_path(s, docs), s) for s in SECTIONS}
    loads = [x for d in stored.values() if d and d.get("meta") for x in (*d["meta"].get("load_before", [])[:1], *d["meta"].get("load_after", [])[:1])]
    parts = {"links": "Home internet links (issue 23)", "suites": "The other suites (moved here from the README)"}
    out = [
        "# Benchmarks",
        "",
        "Written by `python scripts/bench.py report` from the stored results in `docs/bench/` (one JSON per section, with the "
        "command that made it, the commit, and the machine's 1-minute load average before and after). Re-run one section with "
        "`python scripts/bench.py report --only NAME`, or re-render without running anything with `--render-only`. Every "
        "comparison below was measured side by side in one invocation and is given as a ratio; the numbers are measurements, not "
        "estimates.",
        "",
        *_notes(docs, "intro"),
        f"The machine: {os.cpu_count()} cores, shared with other jobs while these ran: 1-minute load average "
        f"{min(loads):.1f}–{max(loads):.1f} across the sections (each section says its own), so absolute throughputs are rough and "
        "the ratios, measured side by side, are the figures to rely on." if loads else "No section has been run yet.",
        "",
    ]
    out += _summary(stored)
    for part, heading in parts.items():
        out += [f"## {heading}", ""]
        for s in (s for s in SECTIONS if s.part == part):
            data = stored[s.name]
            out += [f'<a id="{s.anchor}"></a>', ""] if s.anchor else []
            out += [f"### {s.title}", ""]
            meta = (data or {}).get("meta", {})
            cmd = meta.get("command") or " ".join(_command(s, False))
            when = (f" — {meta['finished']}, commit {meta.get('commit')}, {meta.get('seconds')} s, load average "
                    f"{meta['load_before'][0]} → {meta['load_after'][0]}") if meta.get("finished") else (f" — {meta['note']}" if meta.get("note") else "")
            out += [f"`{cmd}`{when}", ""]
            attempt = meta.get("last_attempt")
            if attempt:
                what = f"skipped: {attempt['skipped']}" if "skipped" in attempt else f"the last run failed ({attempt['failed']})"
                out += [f"*Last attempt ({attempt['at']}): {what}." + (" The result below is the one stored before.*" if data and data.get("result") else "*"), ""]
            if not data or not data.get("result"):
                out += ["No stored result.", ""]
            else:
                module, fn = s.render.split(":")
                out += [getattr(renderers[module], fn)(data["result"], figs, plt), ""]
            if s.anchor:  # one section per suite has the suite's notes
                notes = _notes(docs, s.name)
                out += ["**Earlier, by hand** (before the report; these are the figures the README quotes):", "", *notes] if notes else []
    text = "\n".join(out).rstrip() + "\n"
    (docs / "BENCHMARKS.md").write_text(text, encoding="utf-8")
    return text


def _notes(docs: Path, name: str) -> list[str]:
    """``docs/bench/notes/<name>.md``: what a section says beyond its stored result (measurements taken by hand before
    the report existed, a suite's history, why a number is what it is), as written; nothing when there is none."""
    path = (docs if (docs / "bench" / "notes").is_dir() else DOCS) / "bench" / "notes" / f"{name}.md"
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return []
    return [text, ""] if text else []


def _summary(stored: dict[str, Any]) -> list[str]:
    fmt = _load("report_format")
    links = (stored.get("links") or {}).get("result") or {}
    inet = (stored.get("internet") or {}).get("result") or {}
    pipe = (stored.get("pipeline") or {}).get("result") or {}
    rows = []
    if inet.get("p11"):
        for codec, v in inet["p11"].items():
            rows.append([f"P11 `internet_efficiency`, `{codec}`", fmt.dec(v["internet_efficiency"], 3), "none yet (the replica-sync issue: ≥ 0.7)"])
        rows.append(["replica averaging's share of a step on `50mbit,40ms`", fmt.pct(inet.get("averaging_share_50mbit_40ms")), "–"])
    sync = (stored.get("sync") or {}).get("result") or {}
    if sync.get("best"):
        best = f"`{sync['best']}`"
        rows.append([f"replica sync `bytes_reduction`, {best} vs per-step `none`", fmt.dec(sync.get("bytes_reduction"), 1), "≥ 100 (issue 24)"])
        rows.append([f"replica sync `loss_rel_diff`, {best}", fmt.pct(sync.get("loss_rel_diff")), "≤ 3% (issue 24)"])
        rows.append([f"replica sync `internet_efficiency`, {best}", fmt.dec(sync.get("internet_efficiency"), 3), "≥ 0.7 (issue 24)"])
    for rate, v in (links.get("rate_ratio") or {}).items():
        rows.append([f"link `rate_ratio`, {rate}", fmt.dec(v, 3), "0.9–1.05"])
    if links.get("rtt_ratio") is not None:
        rows.append(["link `rtt_ratio` (open stream, 2 × 40 ms)", fmt.dec(links["rtt_ratio"], 3), "0.95–1.2"])
    for rate, v in (links.get("kernel_ratio") or {}).items():
        rows.append([f"link `kernel_ratio` (ours ÷ tbf), {rate}", fmt.dec(v, 3), "0.9–1.1"])
    for b, v in (pipe.get("by_batch") or {}).items():
        old_reference = v.get("reference_threads") != 1  # stored before the reference became one thread × S: no yardstick
        rows.append([f"pipeline efficiency B={b}, loopback / `50mbit,40ms`", f"{fmt.dec(v['loopback_efficiency'], 3)} / {fmt.dec(v['link_efficiency'], 3)}",
                     "– (an all-core reference that spin-waited under load: see the section)" if old_reference else "–"])
    coord = (stored.get("coordinator-net") or {}).get("result") or {}
    if coord.get("levels"):
        rows.append(["coordinator over the network: `members_sustained` (p99 heartbeat < 1 s, on the shared 2 cores)",
                     fmt.num(coord.get("members_sustained")), f"≥ {fmt.num(coord.get('goal_members'))}"])
    return (["## Summary", "", fmt.table(["figure", "measured", "goal"], rows), ""] if rows else [])


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.py report", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated section names to run (the rest keep their stored results)")
    parser.add_argument("--render-only", action="store_true", help="run nothing; rewrite the document from the stored results")
    parser.add_argument("--quick", action="store_true", help="the sections' short variants, into --docs (default: a temporary folder)")
    parser.add_argument("--docs", type=Path, default=None, help="where BENCHMARKS.md and bench/ go (default: docs/)")
    parser.add_argument("--list", action="store_true", help="list the sections and their commands")
    parser.add_argument("--no-figures", action="store_true", help="write the markdown without (re)drawing the PNGs")
    args = parser.parse_args(argv)
    names = list(dict.fromkeys(s.name for s in SECTIONS))
    if args.list:
        return {"sections": {s.name: " ".join(_command(s, False)) + ("" if s.default else "  (only with --only)") for s in SECTIONS}}
    docs = args.docs or (Path(tempfile.mkdtemp(prefix="protolearn-report-")) if args.quick else DOCS)
    chosen = [n for n in (args.only.split(",") if args.only else []) if n]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise SystemExit(f"error: unknown report sections {unknown}; choose from {', '.join(names)}")
    status: dict[str, str] = {}
    if not args.render_only:
        for name in chosen or names:
            s = next(s for s in SECTIONS if s.name == name)
            if not chosen and not s.default:
                status[name] = "stored (run it with --only)"
                continue
            if args.quick and s.quick is None:
                status[name] = "not in --quick"
                continue
            status[name] = run_section(s, docs, args.quick)
    render(docs, figures=not args.no_figures)
    inet = (_read(_stored_path(SECTIONS[1], docs), SECTIONS[1]) or {}).get("result") or {}
    return {"document": str(docs / "BENCHMARKS.md"), "internet_efficiency": inet.get("internet_efficiency"), "best_codec": inet.get("best"),
            "p11": {c: v["internet_efficiency"] for c, v in (inet.get("p11") or {}).items()}, "sections": status}
