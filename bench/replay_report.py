"""``kvshelf replay``'s output: a rich table, the JSON file and a PNG plot of hit rate vs capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

from kvshelf.kvstore.errors import KVShelfError
from kvshelf.kvstore.replay import ReplayReport


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(report: ReplayReport) -> Table:
    """One row per policy and capacity: its prefix-hit rate next to OPT's and LRU's at the same capacity."""
    title = (f"replay {report.trace}: {report.requests} requests, {report.distinct_blocks} distinct blocks of "
             f"{_size(report.block_bytes)}, {report.tier} tier ({report.seconds:.1f} s)")
    return results_table(report.as_json(), title)


def results_table(payload: dict[str, Any], title: str | None = None) -> Table:
    """``render``'s table from the saved JSON (``ReplayReport.as_json``). The JSON keeps neither the request
    count, the distinct blocks nor the seconds, so the default title names the trace, the block size and the
    tier only."""
    if title is None:
        rows = payload["results"]
        first = rows[0] if rows else {"block_bytes": 0, "tier": "?"}
        title = f"replay {payload['trace']}: blocks of {_size(first['block_bytes'])}, {first['tier']} tier"
    table = Table(title=title, title_justify="left", caption="* the default policy (kvstore.eviction.DEFAULT_POLICY)",
                  caption_justify="left")
    table.add_column("policy")
    table.add_column("capacity")
    for name in ("bytes", "hit rate", "OPT", "LRU", "/ OPT", "/ LRU"):
        table.add_column(name, justify="right")
    for row in payload["results"]:
        policy = row["policy"] + (" *" if row["default"] else "")
        fraction = row["capacity_fraction"]
        capacity = row["capacity"] if row["capacity"] == f"{fraction:g}" else f"{row['capacity']} ({fraction:.3g})"
        table.add_row(policy, capacity, _size(row["capacity_bytes"]), _rate(row["hit_rate"]),
                      _rate(row["opt_hit_rate"]), _rate(row["lru_hit_rate"]), _rate(row["ratio_to_opt"]),
                      _rate(row["ratio_to_lru"]))
    return table


def check_output(path: str | Path, option: str) -> Path:
    """Refuse an output path that cannot be written before a long replay starts (its folder is created)."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KVShelfError(f"cannot write {option} {out}: {exc.strerror or exc}") from None
    if out.is_dir():
        raise KVShelfError(f"cannot write {option} {out}: it is a directory")
    return out


def write_json(report: ReplayReport, path: str | Path) -> Path:
    """``{"trace": str, "results": [...]}`` to ``path`` (its folder is created); ``KVShelfError`` if unwritable."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.as_json(), indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise KVShelfError(f"cannot write --json {out}: {exc.strerror or exc}") from None
    return out


def plot(report: ReplayReport, path: str | Path) -> Path:
    """Hit rate vs capacity fraction (log x): one line per policy, OPT dashed, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report.as_json()["results"]
    series: dict[str, list[dict[str, Any]]] = {}
    for row in results:
        series.setdefault(row["policy"], []).append(row)
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, rows in series.items():
        rows = sorted(rows, key=lambda r: r["capacity_fraction"])
        label = policy + (" (default)" if rows[0]["default"] else "")
        ax.plot([r["capacity_fraction"] for r in rows], [r["hit_rate"] for r in rows], marker="o", label=label)
    opt = sorted({(r["capacity_fraction"], r["opt_hit_rate"]) for r in results})
    ax.plot([f for f, _ in opt], [h for _, h in opt], "k--", marker="x", label="OPT (Belady)")
    if len(opt) > 1 and opt[-1][0] / opt[0][0] >= 4:
        ax.set_xscale("log")
    ax.set_xlabel("capacity (fraction of the trace's distinct blocks)")
    ax.set_ylabel("prefix-hit rate")
    ax.set_ylim(0, max(0.05, max(h for _, h in opt) * 1.1))
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"{Path(report.trace).name}: {report.requests} requests, {report.tier} tier")
    fig.tight_layout()
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, format="png")
    except OSError as exc:
        raise KVShelfError(f"cannot write --plot {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out


__all__ = ["check_output", "plot", "render", "write_json"]
