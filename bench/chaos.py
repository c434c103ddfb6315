"""``kvshelf bench chaos``: a reliability run of the service with Redis as the shared tier.

``clients`` threads do mixed put / get / lookup against one ``kvshelf serve`` for ``seconds``. Midway the
server (``--durability`` as given: what an acknowledged put survives) is SIGKILLed and restarted on the same port
and data directory; later Redis is stopped for
``redis_down_s`` seconds and started again (empty: no persistence). Every get is verified byte for byte
against what was put: a wrong block is counted as ``wrong`` and must be 0. Clients recover from errors on
their own; at the end every block whose put was acknowledged before the kill must still be readable.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import machine_description, save_results
from kvshelf.bench.servers import KVShelfProcess, RedisProcess, free_port
from kvshelf.kvstore import KVBlock, encode_block
from kvshelf.kvstore.errors import KVShelfError

NAMESPACE = "chaos"
RECOVERY_LIMIT_S = 60.0  # how long after Redis is back the run waits for every client to work again


def _value(client: int, n: int, tokens: int = 64) -> tuple[bytes, bytes]:
    """A deterministic encoded block (~100 KB) and its key for put number ``n`` of ``client``."""
    key = hashlib.blake2b(f"chaos:{client}:{n}".encode(), digest_size=16).digest()
    gen = torch.Generator().manual_seed(client * 1_000_003 + n)
    block = KVBlock(torch.randn(4, 2, tokens, 32, generator=gen).half(), torch.randn(4, 2, tokens, 32,
                    generator=gen).half(), tuple(range(tokens)), 0, "c" * 32, NAMESPACE)
    return key, encode_block(block, key)


@dataclass
class Ledger:
    """What the clients saw: acknowledged puts (key -> value, time), counts per outcome and each client's last
    successful operation (monotonic time)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[bytes, tuple[bytes, float]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    last_ok: dict[int, float] = field(default_factory=dict)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def succeeded(self, client: int) -> None:
        with self.lock:
            self.last_ok[client] = time.monotonic()

    def clients_ok_since(self, since: float) -> int:
        """How many clients finished an operation after ``since``."""
        with self.lock:
            return sum(t > since for t in self.last_ok.values())


def _client(index: int, address: str, ledger: Ledger, stop: threading.Event) -> None:
    from kvshelf.service.client import RemoteStore

    rng = random.Random(index)
    store: RemoteStore | None = None
    n = 0
    while not stop.is_set():
        try:
            if store is None:
                store = RemoteStore(address, namespace=NAMESPACE, timeout_s=10, connect_timeout_s=2)
                ledger.count("connects")
            op = rng.random()
            if op < 0.4 or not ledger.acked:
                key, value = _value(index, n)
                n += 1
                store.put_encoded_many([(key, value)])
                with ledger.lock:
                    ledger.acked[key] = (value, time.monotonic())
                ledger.count("put_ok")
            else:
                with ledger.lock:
                    keys = rng.sample(list(ledger.acked), min(4, len(ledger.acked)))
                    expected = [ledger.acked[k][0] for k in keys]
                if op < 0.8:
                    for got, want in zip(store.get_encoded_many(keys), expected, strict=True):
                        ledger.count("get_miss" if got is None else "get_ok" if got == want else "wrong")
                else:
                    store.lookup_prefix(keys)
                    ledger.count("lookup_ok")
            ledger.succeeded(index)
        except KVShelfError as exc:
            ledger.count(f"error:{type(exc).__name__}")
            if store is not None:
                store.close()
            store = None
            time.sleep(0.2)  # back off, then reconnect
    if store is not None:
        store.close()


def run(*, json_path: str | None, seconds: float = 60, clients: int = 8, redis_down_s: float = 10,
        durability: str = "fsync", console: Console | None = None) -> dict[str, Any]:
    from kvshelf.service.client import RemoteStore

    console = console or Console()
    ledger = Ledger()
    stop = threading.Event()
    events: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvshelf-chaos-") as tmp:
        redis = RedisProcess(free_port(), Path(tmp) / "redis")
        redis.start()
        server = KVShelfProcess(Path(tmp) / "data", "--memory", "256MiB", "--redis", redis.url, "--grace", "1",
                                "--durability", durability)
        server.start()
        started = time.monotonic()
        threads = [threading.Thread(target=_client, args=(i, server.address, ledger, stop)) for i in range(clients)]
        for t in threads:
            t.start()

        def at(fraction: float) -> None:
            time.sleep(max(0.0, started + fraction * seconds - time.monotonic()))

        at(0.3)
        server.kill()
        killed_at = time.monotonic()
        events.append(f"{killed_at - started:.1f}s server SIGKILLed")
        server.start()
        events.append(f"{time.monotonic() - started:.1f}s server restarted")
        at(0.55)
        redis.stop()
        events.append(f"{time.monotonic() - started:.1f}s redis stopped")
        time.sleep(redis_down_s)
        redis.start()
        redis_back = time.monotonic()
        events.append(f"{redis_back - started:.1f}s redis restarted (empty)")
        at(1.0)
        # the run ends once every client has worked again after the restart (a slow machine takes longer), or
        # RECOVERY_LIMIT_S after it: then ``recovered_clients`` says how many did
        while ledger.clients_ok_since(redis_back) < clients and time.monotonic() < redis_back + RECOVERY_LIMIT_S:
            time.sleep(0.1)
        recovered = ledger.clients_ok_since(redis_back)
        events.append(f"{time.monotonic() - started:.1f}s stopped: {recovered} of {clients} clients worked again "
                      "after the restarts")
        stop.set()
        for t in threads:
            t.join()
        before_kill = {k: v for k, (v, t) in ledger.acked.items() if t < killed_at}
        checker = RemoteStore(server.address, namespace=NAMESPACE)
        keys = list(before_kill)
        readable = 0
        for start in range(0, len(keys), 64):
            batch = keys[start : start + 64]
            readable += sum(got == before_kill[k] for k, got in zip(batch, checker.get_encoded_many(batch),
                                                                     strict=True))
        checker.close()
        server.terminate()
        redis.stop()
    counts = dict(sorted(ledger.counts.items()))
    payload = {
        "machine": machine_description(), "seconds": seconds, "clients": clients, "redis_down_s": redis_down_s,
        "durability": durability,
        "events": events, "counts": counts, "wrong": counts.get("wrong", 0),
        "acked_before_kill": len(before_kill), "readable_after_restart": readable, "recovered_clients": recovered,
        "ok": counts.get("wrong", 0) == 0 and readable == len(before_kill) and recovered == clients,
    }
    console.print(results_table(payload))
    for line in events:
        console.print(f"  {line}")
    console.print("[green]OK[/green]: no wrong block, nothing committed lost, every client worked again"
                  if payload["ok"]
                  else "[red]FAILED[/red]: see counts and events")
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it). A payload saved
    before ``durability`` was recorded ran with the default, fsync."""
    table = Table(title=f"chaos: {payload['clients']} clients, {payload['seconds']:g} s, --durability "
                        f"{payload.get('durability', 'fsync')} ({payload['machine']})")
    table.add_column("what")
    table.add_column("count", justify="right")
    for name, value in payload["counts"].items():
        table.add_row(name, str(value))
    table.add_row("blocks acknowledged before the kill", str(payload["acked_before_kill"]))
    table.add_row("of those readable after restart", str(payload["readable_after_restart"]))
    if "recovered_clients" in payload:  # recorded since the run waits for every client to recover
        table.add_row("clients that worked again after the restarts", str(payload["recovered_clients"]))
    return table
