"""``kvshelf bench lmdb-capacity``: a bounded LMDB tier under random puts and gets for a fixed time.

The figure: an ``LMDBTier`` with a 256 MiB capacity under 10 minutes of random puts of 1-8 MiB
blocks: the file never exceeds capacity + slack (``kvstore.lmdb_tier.lmdb_slack_bytes``), 0 errors, and every
get returns a correct block or a counted miss.

Traffic: one thread; each step is a put (half the steps) of a random key of a pool of ``4 x capacity / mean
block`` keys, with a new version of that key's value of a random size in ``[min_block, max_block]``, or a get
of a random key put before. Values are verifiable without keeping them: ``make_value(key, version, size)`` is a
header (version, size, key) and bytes derived from all three, so a get is *correct* only when it returns exactly
the bytes of the last version put for that key (a torn, mixed, stale or foreign value is *wrong*). A get may miss
(the key was evicted): counted. The file size is read after every put; its maximum is compared with the bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

_HEADER = struct.Struct("<QQ")  # version, size; then the key
_CHUNK = 4096
MiB = 1 << 20


def make_value(key: bytes, version: int, size: int) -> bytes:
    """A value of ``size`` bytes for ``key`` at ``version``: header, then bytes derived from all three."""
    head = _HEADER.pack(version, size) + key
    if size < len(head):
        raise ValueError(f"a value needs at least {len(head)} bytes, asked for {size}")
    chunk = hashlib.shake_256(head).digest(_CHUNK)
    body = size - len(head)
    return head + (chunk * (body // _CHUNK + 1))[:body]


def value_version(key: bytes, value: bytes) -> int | None:
    """The version ``value`` is of ``key``'s values, or None when it is not exactly such a value."""
    if len(value) < _HEADER.size + len(key):
        return None
    version, size = _HEADER.unpack_from(value)
    if size != len(value) or value[_HEADER.size : _HEADER.size + len(key)] != key:
        return None
    return version if value == make_value(key, version, size) else None


def run(*, duration_s: float, capacity: int, min_block: int = MiB, max_block: int = 8 * MiB, seed: int = 0,
        durable: bool = True, policy: str = "lru", slack: int | None = None, data_dir: str | None = None,
        json_path: str | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the traffic for ``duration_s`` seconds on a fresh tier in ``data_dir`` (a temporary directory when
    None); print a table, write ``json_path``; return the results (``ok``: every invariant held). ``slack``: the
    tier's ``slack_bytes`` (default: ``lmdb_slack_bytes``): more slack, fewer puts that find the map full."""
    from kvshelf.bench.common import machine_description
    from kvshelf.kvstore.lmdb_tier import LMDBTier

    console = console or Console()
    if not 0 < min_block <= max_block:
        raise ValueError(f"block sizes must satisfy 0 < min ({min_block}) <= max ({max_block})")
    rng = random.Random(seed)
    pool = [hashlib.blake2b(f"block-{i}".encode(), digest_size=16).digest()
            for i in range(max(8, 8 * capacity // (min_block + max_block)))]
    latest: dict[bytes, int] = {}  # key -> last version put (and stored)
    counts = dict(puts=0, stored=0, not_stored=0, gets=0, hits=0, misses=0, wrong=0, errors=0, evictions=0,
                  evicted_wrong=0)
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-lmdb-capacity-") as tmp:
        path = Path(data_dir or tmp) / "lmdb"
        tier = LMDBTier(path, capacity_bytes=capacity, policy=policy, durable=durable, slack_bytes=slack)
        bound = capacity + int(tier.slack_bytes or 0)

        def evicted(key: bytes, value: bytes) -> None:
            counts["evictions"] += 1
            if value_version(key, value) is None:
                counts["evicted_wrong"] += 1

        tier.set_eviction_callback(evicted)
        data = path / "data.mdb"
        max_file = os.path.getsize(data)
        version = 0
        held_sum = 0  # held bytes after each put, summed: the mean occupancy
        start = time.monotonic()
        try:
            while time.monotonic() - start < duration_s:
                try:
                    if not latest or rng.random() < 0.5:
                        key = rng.choice(pool)
                        version += 1
                        counts["puts"] += 1
                        if tier.put_many([(key, make_value(key, version, rng.randint(min_block, max_block)))]):
                            counts["stored"] += 1
                            latest[key] = version
                        else:
                            counts["not_stored"] += 1
                        max_file = max(max_file, os.path.getsize(data))
                        held_sum += tier.usage().bytes
                    else:
                        key = rng.choice(list(latest))
                        counts["gets"] += 1
                        got = tier.get_many([key])[0]
                        if got is None:
                            counts["misses"] += 1
                        elif value_version(key, got) == latest[key]:
                            counts["hits"] += 1
                        else:
                            counts["wrong"] += 1
                except Exception as exc:  # noqa: BLE001 - every failure of the tier is a counted error
                    counts["errors"] += 1
                    if len(errors) < 5:
                        errors.append(f"{type(exc).__name__}: {exc}")
            elapsed = time.monotonic() - start
            usage = tier.usage()
            audit = tier.audit()
            retries = tier.map_full_retries
        finally:
            tier.close()
        final_file = os.path.getsize(data)
    ok = (max_file <= bound and counts["errors"] == 0 and counts["wrong"] == 0 and counts["evicted_wrong"] == 0
          and not audit and usage.bytes <= capacity)
    result: dict[str, Any] = {
        "machine": machine_description(), "duration_s": round(elapsed, 1), "capacity_bytes": capacity,
        "slack_bytes": bound - capacity, "bound_bytes": bound, "min_block_bytes": min_block,
        "max_block_bytes": max_block, "policy": policy, "durable": durable, "keys": len(pool), **counts,
        "map_full_retries": retries, "max_file_bytes": max_file, "final_file_bytes": final_file,
        "held_bytes": usage.bytes, "held_blocks": usage.blocks, "audit": audit,
        "mean_held_fraction": round(held_sum / max(counts["puts"], 1) / capacity, 4),
        "puts_per_s": round(counts["puts"] / elapsed, 1) if elapsed else 0.0, "errors_seen": errors, "ok": ok,
    }
    console.print(results_table(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it). The duration in
    the title is the payload's ``duration_s`` (rounded to 0.1 s when saved)."""
    capacity, bound = payload["capacity_bytes"], payload["bound_bytes"]
    table = Table(title=f"LMDB tier, capacity {capacity / MiB:g} MiB, blocks {payload['min_block_bytes'] / MiB:g}-"
                        f"{payload['max_block_bytes'] / MiB:g} MiB, {payload['duration_s']:.0f} s")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name in ("puts", "stored", "not_stored", "gets", "hits", "misses", "wrong", "evictions", "errors",
                 "map_full_retries"):
        table.add_row(name, str(payload[name]))
    table.add_row("max file size", f"{payload['max_file_bytes'] / MiB:.2f} MiB")
    table.add_row("capacity + slack", f"{bound / MiB:.2f} MiB ({capacity / MiB:g} + {(bound - capacity) / MiB:.2f})")
    table.add_row("held at the end", f"{payload['held_bytes'] / MiB:.2f} MiB in {payload['held_blocks']} blocks")
    table.add_row("mean held after a put", f"{100 * payload['mean_held_fraction']:.1f}% of the capacity")
    table.add_row("invariants", "[green]held[/green]" if payload["ok"] else "[red]BROKEN[/red]")
    return table
