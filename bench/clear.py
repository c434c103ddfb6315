"""``kvshelf bench clear``: what ``Clear(namespace)`` costs on a large Redis, the old path against the new one.

A Redis-only ``TieredStore`` (the tier every process of a service shares) is filled with ``other`` small values of
other namespaces (service tier keys: an 8-byte namespace tag + a 16-byte key, spread over ``namespaces`` tags) and
``ns_keys`` of the namespace cleared. Then, on the same data (the cleared namespace written again between runs):

* ``old``: the naive path (the anchor): list every key of the tier (``SCAN`` matching the tier's
  prefix: every manifest of every namespace comes back to the client), keep the namespace's, then
  ``TieredStore.delete`` (a ``contains`` round trip per key and tier, for the removed events);
* ``new``: ``TieredStore.clear_prefix`` (what the server's ``Clear`` does): a ``SCAN`` whose ``MATCH`` names the
  namespace's tag (Redis filters; only its manifests come back), each page removed at once (``GETDEL`` +
  ``UNLINK``).

Each row: keys in Redis before, keys cleared, seconds, Redis's own counts from ``INFO commandstats`` (summed over
primaries): SCAN calls, the seconds Redis spent in them and their average per call (how long one call blocks Redis:
set by the ``COUNT`` hint, ``--scan-count``), and all commands. Standalone, and with ``--cluster`` a local 3-primary
Redis Cluster (started here, like the standalone server, on free ports).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import machine_description, save_results
from kvshelf.bench.servers import HOST, RedisProcess, cluster_args, form_cluster, free_port
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import KEY_BYTES, SCOPE_BYTES, SCOPED_KEY_BYTES, BlockKey, ScopeTag, scope
from kvshelf.kvstore.redis_tier import CLEAR_SCAN_COUNT

PREFIX = "bench-clear:"
PUT_BATCH = 1000


def _tag(n: int) -> ScopeTag:
    return ScopeTag(n.to_bytes(SCOPE_BYTES, "big"))


def _keys(tag: ScopeTag, count: int, seed: int) -> list[bytes]:
    return [scope(tag, BlockKey((seed * 10_000_000 + i).to_bytes(KEY_BYTES, "big"))) for i in range(count)]


def _start_cluster(workdir: Path, size: int = 3) -> list[RedisProcess]:
    nodes = [RedisProcess(free_port(), workdir / f"node-{n}", cluster_args(workdir / f"node-{n}")) for n in range(size)]
    form_cluster(nodes)
    return nodes


def _commandstats(nodes: list[RedisProcess]) -> dict[str, int]:
    """Redis's command counts, summed over ``nodes``: SCAN calls and usec, every command's calls."""
    out = {"scan_calls": 0, "scan_usec": 0, "commands": 0, "keys": 0}
    for node in nodes:
        with node.client() as client:
            stats = client.info("commandstats")
            out["keys"] += int(client.dbsize())
        for name, row in stats.items():
            out["commands"] += int(row["calls"])
            if name == "cmdstat_scan":
                out["scan_calls"] += int(row["calls"])
                out["scan_usec"] += int(row["usec"])
    return out


def _reset(nodes: list[RedisProcess]) -> None:
    for node in nodes:
        with node.client() as client:
            client.config_resetstat()


def _fill(store: Any, keys: list[bytes], value: bytes) -> None:
    for start in range(0, len(keys), PUT_BATCH):
        batch = keys[start:start + PUT_BATCH]
        stored = store.specs[0].tier.put_many([(key, value) for key in batch])
        if stored != len(batch):
            raise ConfigError(f"Redis took {stored} of {len(batch)} values: give it more memory")


def _measure(path: str, store: Any, nodes: list[RedisProcess], tag: bytes) -> dict[str, Any]:
    tier = store.specs[0].tier
    before = _commandstats(nodes)
    _reset(nodes)
    start = time.perf_counter()
    if path == "old":
        listed = tier.keys()  # what service.usage.tier_keys did
        keys = [k for k in listed if len(k) == SCOPED_KEY_BYTES and k.startswith(tag)]
        store.delete(keys)
        cleared = len(keys)
    else:
        cleared = store.clear_prefix(tag, SCOPED_KEY_BYTES)
    seconds = time.perf_counter() - start
    after = _commandstats(nodes)
    return {"path": path, "keys_in_redis": before["keys"], "keys_cleared": cleared, "seconds": round(seconds, 4),
            "scan_calls": after["scan_calls"], "scan_redis_seconds": round(after["scan_usec"] / 1e6, 4),
            "commands": after["commands"], "keys_left": after["keys"],
            "avg_redis_ms_per_scan_call": None if not after["scan_calls"] else round(
                after["scan_usec"] / after["scan_calls"] / 1e3, 3)}


def run(*, json_path: str | None, other: int = 1_000_000, ns_keys: int = 10_000, namespaces: int = 100,
        value_bytes: int = 64, cluster: bool = False, paths: tuple[str, ...] = ("old", "new"),
        scan_count: int | None = None, console: Console | None = None) -> dict[str, Any]:
    from kvshelf.kvstore import RedisTier, TieredStore

    console = console or Console()
    value = os.urandom(value_bytes)
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-clear-") as workdir:
        if cluster:
            nodes = _start_cluster(Path(workdir))
            url = f"redis+cluster://{HOST}:{nodes[0].port}"
        else:
            nodes = [RedisProcess(free_port(), Path(workdir))]
            nodes[0].start()
            url = nodes[0].url
        try:
            tier = RedisTier.from_url(url, prefix=PREFIX, socket_timeout=30)
            if scan_count is not None:
                tier.clear_scan_count = scan_count
            store = TieredStore([tier])
            started = time.perf_counter()
            per = max(other // max(namespaces, 1), 1)
            for n in range(namespaces):
                _fill(store, _keys(_tag(1000 + n), min(per, other - n * per), n + 1), value)
            cleared_tag = _tag(7)
            fill_s = time.perf_counter() - started
            console.print(f"filled {other} values of {namespaces} other namespaces in {fill_s:.1f} s")
            rows = []
            for path in paths:
                _fill(store, _keys(cleared_tag, ns_keys, 0), value)
                row = _measure(path, store, nodes, cleared_tag)
                if row["keys_cleared"] != ns_keys:
                    raise ConfigError(f"{path}: cleared {row['keys_cleared']} of {ns_keys} keys")
                rows.append(row)
            usage = tier.usage()
            store.close()
        finally:
            for node in nodes:
                node.stop()
    mode = "cluster (3 primaries)" if cluster else "standalone"
    payload = {"bench": "clear", "machine": machine_description(), "redis": mode, "other_keys": other,
               "namespace_keys": ns_keys, "namespaces": namespaces, "value_bytes": value_bytes,
               "new_scan_count": scan_count or CLEAR_SCAN_COUNT, "rows": rows,
               "usage_after": {"blocks": usage.blocks, "bytes": usage.bytes}}
    if len(rows) == 2:
        payload["speedup"] = round(rows[0]["seconds"] / rows[1]["seconds"], 2) if rows[1]["seconds"] else None
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"Clear(namespace) on Redis {payload['redis']}: {payload['namespace_keys']} keys among "
                        f"{payload['other_keys']} of other namespaces")
    for column in ("path", "keys in Redis", "cleared", "seconds", "SCAN calls", "Redis s in SCAN", "commands"):
        table.add_column(column, justify="right")
    for row in payload["rows"]:
        table.add_row(row["path"], str(row["keys_in_redis"]), str(row["keys_cleared"]), f"{row['seconds']:.3f}",
                      str(row["scan_calls"]), f"{row['scan_redis_seconds']:.3f}", str(row["commands"]))
    return table

