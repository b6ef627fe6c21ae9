"""What the report's renderers share: markdown tables, number formats and matplotlib set-up.

The renderers (``report_links.py``, ``report_suites.py``) turn one suite's stored JSON into markdown
and, where a figure helps, a PNG next to it; this module keeps them to one look.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def num(x: Any, digits: int = 3) -> str:
    """A measured number for a table: ``digits`` significant digits, thousands separated; '–' if missing."""
    if x is None or isinstance(x, str) and not x:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:  # NaN
            return "–"
        if abs(x) >= 10 ** digits:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def dec(x: Any, places: int = 3) -> str:
    """A ratio or a loss: a fixed number of decimals, so 1.000 reads as measured and not as rounded."""
    if x is None or isinstance(x, bool) or not isinstance(x, int | float) or x != x:
        return num(x)
    return f"{x:.{places}f}"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def get(d: Any, *path: Any, default: Any = None) -> Any:
    """``d[path[0]][path[1]]...``, or ``default`` when any step is missing."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (then no PNGs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path) -> str:
    """Write ``fig`` to ``path`` and return the markdown image line (relative to docs/)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"![{path.stem}]({path.parent.name}/{path.name})"


def bars(plt: Any, path: Path, labels: Sequence[str], series: dict[str, Sequence[float | None]], *, ylabel: str, title: str,
         hline: float | None = None, log: bool = False) -> str:
    """Grouped bars: one group per label, one bar per series."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if hline is not None:
        ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
    if log:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend(fontsize=8)
    return save(fig, path)


def notes(figs: Path, name: str) -> list[str]:
    """The hand-written notes kept under a section's table (``docs/bench/notes/NAME.md``), as report lines; none if absent."""
    path = figs / "notes" / f"{name}.md"
    return ["", path.read_text(encoding="utf-8").strip()] if path.exists() else []
