"""``kvshelf bench lmdb``: reading an 8 MiB block from the LMDB tier vs a raw LMDB read, same run.

* ``raw-lmdb``: ``lmdb`` itself: one read transaction, ``txn.get`` of the 8 MiB value (a copy to ``bytes``);
* ``tier-get``: ``LMDBTier.get_many`` (the same, behind the tier's lock and resize handling);
* ``store-get``: ``TieredStore.get_many`` on a disk-only store: tier read + checksum + header checks + decode
  to tensors (what the adapters use).

Throughput is the block's encoded size over the median time of ``reps`` reads.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import torch
from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import machine_description, median, save_results

SHAPE = (32, 8, 64, 64)  # float32 keys + values: exactly 8 MiB of payload


def _median_seconds(fn: Any, reps: int) -> float:
    fn()  # first touch of the pages out of the timing
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def run(*, json_path: str | None, reps: int = 50, console: Console | None = None) -> dict[str, Any]:
    from kvshelf.kvstore import KVBlock, LMDBTier, TieredStore, encode_block
    from kvshelf.kvstore.keys import chunk_key

    console = console or Console()
    generator = torch.Generator().manual_seed(0)
    block = KVBlock(torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator),
                    tuple(range(SHAPE[2])), 0, "b" * 32, "bench")
    key = chunk_key(block.fingerprint, block.namespace, block.token_ids)
    value = encode_block(block, key)
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-lmdb-") as tmp:
        raw_env = lmdb.open(str(Path(tmp) / "raw"), map_size=1 << 30, readahead=True)
        with raw_env.begin(write=True) as txn:
            txn.put(key, value)

        def raw_read() -> None:
            with raw_env.begin() as txn:
                assert len(txn.get(key)) == len(value)

        tier = LMDBTier(Path(tmp) / "tier")
        tier.put_many([(key, value)])
        store = TieredStore([tier])

        def tier_read() -> None:
            assert tier.get_many([key])[0] is not None

        def store_read() -> None:
            assert store.get_many([key], fingerprint=block.fingerprint, namespace="bench", copy=False)[0]

        timings = {
            "raw-lmdb": _median_seconds(raw_read, reps),
            "tier-get": _median_seconds(tier_read, reps),
            "store-get": _median_seconds(store_read, reps),
        }
        raw_env.close()
        store.close()
    anchor = timings["raw-lmdb"]
    results = [
        {"path": name, "block_mib": round(len(value) / 2**20, 2), "ms": round(1000 * s, 3),
         "gb_s": round(len(value) / s / 1e9, 2), "vs_raw_lmdb": round(anchor / s, 2), "anchor": name == "raw-lmdb"}
        for name, s in timings.items()
    ]
    payload = {"machine": machine_description(), "reps": reps, "results": results}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"LMDB read of one 8 MiB block, median of {payload['reps']} ({payload['machine']})")
    for col in ("path", "MiB", "ms", "GB/s", "vs raw LMDB"):
        table.add_column(col, justify="right")
    for r in payload["results"]:
        table.add_row(r["path"], f"{r['block_mib']:.2f}", f"{r['ms']:.2f}", f"{r['gb_s']:.2f}",
                      f"{r['vs_raw_lmdb']:.2f}x")
    return table
