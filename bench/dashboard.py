"""``kvshelf bench dashboard``: the server time of one call of the admin dashboard's data endpoint
(``service/dashboard.py``: a fresh snapshot of the store's counters and the reused-prefix table, as JSON).

Method: an embedded store whose counters hold ``namespaces`` x ``models`` rows in every tier, a full table of
reused prefixes (``HotPrefixes``), and ``calls`` calls of ``DashboardApp.data`` timed in process (no HTTP, no
snapshot sharing between calls); median, p90 and mean. The target is 1 ms per call.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from rich.table import Table

from kvshelf.bench.common import machine_description, save_results
from kvshelf.kvstore.embedded import open_embedded_store
from kvshelf.kvstore.stats import Metric
from kvshelf.service.dashboard import DashboardApp
from kvshelf.service.dashboard_data import local_snapshot
from kvshelf.service.hot_prefixes import HotPrefixes

METRICS = (Metric.HITS, Metric.MISSES, Metric.EVICTIONS, Metric.LOOKUP_BLOCKS, Metric.LOOKUP_HIT_BLOCKS,
           Metric.RETRIEVE_BLOCKS, Metric.RETRIEVE_HIT_BLOCKS)


def run(*, json_path: str | None, calls: int = 500, namespaces: int = 8, models: int = 2, console: Any) -> dict:
    with tempfile.TemporaryDirectory() as data_dir:
        store = open_embedded_store(data_dir, memory_bytes="16MiB", max_disk_bytes="64MiB")
        try:
            for i in range(namespaces * models):
                ns, model = f"tenant-{i % namespaces}", f"model-{i // namespaces}"
                for tier in ("memory", "disk", "*"):
                    for metric in METRICS:
                        store.counters.add(tier, ns, model, metric, 10 + i)
            hot = HotPrefixes()
            for i in range(hot.capacity * 2):
                hot.hit(f"tenant-{i % namespaces}", i.to_bytes(16, "big"), i % 7 + 1)
            app = DashboardApp(lambda: local_snapshot(store, events_seq=lambda: 1234, hot=hot))
            app.data()
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                app.data()
                times.append(time.perf_counter() - start)
        finally:
            store.close()
    payload = {"bench": "dashboard", "machine": machine_description(), "calls": calls, "namespaces": namespaces,
               "models": models, "median_us": round(statistics.median(times) * 1e6, 1),
               "p90_us": round(statistics.quantiles(times, n=10)[-1] * 1e6, 1),
               "mean_us": round(statistics.fmean(times) * 1e6, 1)}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout)."""
    table = Table(title=f"Dashboard data call: {payload['namespaces']} namespaces x {payload['models']} models, "
                        f"a full prefix table, {payload['calls']} calls")
    for column in ("median (µs)", "p90 (µs)", "mean (µs)", "target (µs)"):
        table.add_column(column, justify="right")
    table.add_row(f"{payload['median_us']:.0f}", f"{payload['p90_us']:.0f}", f"{payload['mean_us']:.0f}", "1000")
    return table
