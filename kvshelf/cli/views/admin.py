"""The admin view of a store's statistics: tables for ``kvshelf stats`` and a hit-rate/usage plot.

Input is the JSON-ready dict of ``TieredStore.stats()`` (locally or from the server's ``Stats`` call),
optionally with ``"history"``: the points of ``service.history.StatsHistory``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from kvshelf.kvstore.errors import KVShelfError
from kvshelf.kvstore.stats import ALL_TIERS, BLOCK_COUNTS, Metric


def _pct(hit: float, total: float) -> str:
    return f"{100 * hit / total:.1f}%" if total else "n/a"


def _size(n: float | None) -> str:
    if n is None:
        return "unreachable"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _top(rows: list[dict[str, Any]], by: str, limit: int) -> list[tuple[str, dict[str, int]]]:
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        if row["tier"] == ALL_TIERS:
            for metric in BLOCK_COUNTS:
                totals[str(row[by])][metric.value] += int(row.get(metric, 0))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][Metric.RETRIEVE_BLOCKS] - kv[1][Metric.LOOKUP_BLOCKS])
    return ranked[:limit]


def render(stats: dict[str, Any], title: str = "kvshelf", top: int = 5) -> Group:
    """Hit rates, usage per tier, top namespaces and models."""
    summary = Table(title=f"{title}: hit rates", show_header=True)
    for col in ("", "blocks asked", "block hits", "hit rate (blocks)", "tokens asked", "token hits",
                "hit rate (tokens)"):
        summary.add_column(col, justify="right")
    rows = stats.get("rows", [])

    def total(metric: Metric) -> int:
        return sum(int(r.get(metric, 0)) for r in rows if r["tier"] == ALL_TIERS)

    for kind, counts in (
        ("lookup", (Metric.LOOKUP_BLOCKS, Metric.LOOKUP_HIT_BLOCKS, Metric.LOOKUP_TOKENS, Metric.LOOKUP_HIT_TOKENS)),
        ("retrieve", (Metric.RETRIEVE_BLOCKS, Metric.RETRIEVE_HIT_BLOCKS, Metric.RETRIEVE_TOKENS,
                      Metric.RETRIEVE_HIT_TOKENS)),
    ):
        blocks, block_hits, tokens, token_hits = map(total, counts)
        summary.add_row(kind, str(blocks), str(block_hits), _pct(block_hits, blocks), str(tokens), str(token_hits),
                        _pct(token_hits, tokens))
    tiers = Table(title="tiers")
    for col in ("tier", "codec", "blocks", "bytes", "capacity", "hits", "misses", "hit rate", "evictions",
                "corrupt", "foreign"):
        tiers.add_column(col, justify="right")
    for t in stats.get("tiers", []):
        hits, misses = t[Metric.HITS], t[Metric.MISSES]
        tiers.add_row(t["name"], t["codec"], "-" if t["blocks"] is None else str(t["blocks"]), _size(t["bytes"]),
                      _size(t["capacity_bytes"]) if t["capacity_bytes"] else "-", str(hits), str(misses),
                      _pct(hits, hits + misses), str(t[Metric.EVICTIONS]), str(t[Metric.CORRUPT]),
                      str(t[Metric.FOREIGN]))
    parts: list[Any] = [summary, tiers]
    for by, label in (("namespace", "top namespaces"), ("model", "top models")):
        table = Table(title=label)
        for col in (by, "lookups", "lookup hit rate", "retrievals", "retrieve hit rate"):
            table.add_column(col, justify="right")
        for name, m in _top(rows, by, top):
            lookups, retrieves = m[Metric.LOOKUP_BLOCKS], m[Metric.RETRIEVE_BLOCKS]
            table.add_row(name, str(lookups), _pct(m[Metric.LOOKUP_HIT_BLOCKS], lookups),
                          str(retrieves), _pct(m[Metric.RETRIEVE_HIT_BLOCKS], retrieves))
        parts.append(table)
    return Group(*parts)


def plot(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw retrieve/lookup hit rate per interval and bytes per tier over time to a PNG."""
    if len(history) < 2:
        raise KVShelfError(f"need at least 2 history points to plot, have {len(history)}; let the server run longer")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = history[0]["t"]
    times = [(p["t"] - t0) / 60 for p in history]
    fig, (rate_ax, use_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for kind in ("lookup", "retrieve"):
        rates = []
        for prev, cur in zip(history, history[1:], strict=False):
            asked = cur[f"{kind}_blocks"] - prev[f"{kind}_blocks"]
            hits = cur[f"{kind}_hit_blocks"] - prev[f"{kind}_hit_blocks"]
            rates.append(100 * hits / asked if asked else float("nan"))
        rate_ax.plot(times[1:], rates, marker=".", label=f"{kind} hit rate")
    rate_ax.set_ylabel("hit rate per interval (%)")
    rate_ax.set_ylim(-2, 102)
    rate_ax.legend()
    for tier in history[-1]["tiers"]:
        series = [(p["tiers"].get(tier, {}).get("bytes") or 0) / 2**20 for p in history]
        use_ax.plot(times, series, label=tier)
    use_ax.set_ylabel("MiB held")
    use_ax.set_xlabel("minutes")
    use_ax.legend()
    fig.suptitle("kvshelf: hit rate and usage")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
