"""``kvshelf bench store``: put/get throughput and latency of 1, 8 and 32 MiB blocks, 1 and 8 clients:
the kvshelf gRPC service vs raw redis-py SET/GET vs raw LMDB, in the same run, beside this machine's own limit
for a remote path (``socket-floor``: a bare Python socket server, ``bench/socket_floor.py``).

The kvshelf backends: ``grpc`` (a same-host client's default: gets through a /dev/shm arena, puts over the data
path), ``grpc-wire`` (what a worker on another host uses: every value over the bulk data path, ``service/bulk/``),
``grpc-wire-fsync`` (the same with a per-put fsync: what durability costs), ``grpc-http2`` (every byte over
gRPC's HTTP/2 wire, the path before the data path). ``--durability`` (default ``interval``, as Redis runs without
a per-write fsync) is the server's for all of them but ``grpc-wire-fsync``.

Every client is a process of its own (as inference workers are; ``bench/store_worker.py``) and moves its own
keys; every value is a real encoded block (the service verifies what it stores), and every get is checked byte
for byte against what was put (a mismatch counts as an error). MB/s is the total bytes moved over the wall time
of the case (first op started to last op ended); p50/p99 are per-operation latencies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import machine_description, save_results
from kvshelf.bench.servers import binary
from kvshelf.service.allocator import LARGE_BUFFER_TUNABLES

MiB = 1 << 20
DEFAULT_SIZES = (1, 8, 32)
DEFAULT_CLIENTS = (1, 8)
WORKER_TIMEOUT_S = 600.0

#: A client: ``(put(key, value), get(key) -> bytes | None)``.
ClientPair = tuple[Callable[[bytes, bytes], None], Callable[[bytes], bytes | None]]
#: A backend is a context manager yielding its *target*: a JSON object from which ``connect`` builds a client
#: in any process (the benchmark's clients are processes of their own, as inference workers are).
Backend = Callable[[], AbstractContextManager[dict[str, Any]]]


@contextmanager
def lmdb_backend() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-store-") as tmp:
        path = Path(tmp) / "raw"
        lmdb.open(str(path), map_size=64 << 30).close()
        yield {"kind": "lmdb", "path": str(path)}


@contextmanager
def disk_floor_backend() -> Iterator[dict[str, Any]]:
    """The limit of any store that writes its values to a file on this machine: each value written with one
    ``pwrite`` into a new file of its own, read back with ``readinto`` into a preallocated buffer; no fsync, no
    checks, nothing of kvshelf (the same temporary-files filesystem as the kvshelf servers' LMDB)."""
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-disk-floor-") as tmp:
        yield {"kind": "disk-floor", "path": tmp}


def _disk_floor_client(path: str) -> ClientPair:
    def put(key: bytes, value: bytes) -> None:
        fd = os.open(os.path.join(path, key.hex()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, value, 0)
        finally:
            os.close(fd)

    def get(key: bytes) -> bytes | None:
        try:
            with open(os.path.join(path, key.hex()), "rb", buffering=0) as f:
                value = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(value)
                return value
        except FileNotFoundError:
            return None

    return put, get


@contextmanager
def redis_backend() -> Iterator[dict[str, Any]]:
    from kvshelf.bench.servers import redis_server

    with redis_server() as server:
        yield {"kind": "redis", "url": server.url}


#: ``--durability`` of the kvshelf backends (the server's: ``kvshelf serve --durability``)
DEFAULT_DURABILITY = "interval"


@contextmanager
def grpc_backend(shared_memory: bool | None = None, data_path: bool = True,
                 durability: str = DEFAULT_DURABILITY) -> Iterator[dict[str, Any]]:
    """A `kvshelf serve` process on loopback (memory + LMDB, its defaults but ``durability``) and RemoteStore
    clients.

    ``shared_memory=None`` is what a same-host client gets by default: gets through a /dev/shm arena
    (service/arena.py); ``False``: values over the bulk data path (``data_path``, service/bulk/), else over gRPC's
    HTTP/2 wire.
    """
    from kvshelf.bench.servers import kvshelf_server

    with (tempfile.TemporaryDirectory(prefix="kvshelf-bench-grpc-") as tmp,
          kvshelf_server(tmp, "--durability", durability) as address):
        yield {"kind": "grpc", "address": address, "shared_memory": shared_memory, "data_path": data_path}


@contextmanager
def grpc_bare_backend() -> Iterator[dict[str, Any]]:
    """The floor of the wire path: a bare gRPC Python server with nothing of kvshelf in it (``bench/grpc_bare.py``)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvshelf.bench.grpc_bare"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"the bare gRPC server did not start (exit {proc.poll()}): {line.strip()!r}")
        yield {"kind": "grpc-bare", "address": f"127.0.0.1:{line.strip()}"}
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def socket_floor_backend() -> Iterator[dict[str, Any]]:
    """The limit of this machine for a remote path: a bare Python socket server (``bench/socket_floor.py``)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvshelf.bench.socket_floor"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"the socket-floor server did not start (exit {proc.poll()}): {line.strip()!r}")
        yield {"kind": "socket-floor", "address": f"127.0.0.1:{line.strip()}"}
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def grpc_wire_backend(durability: str = DEFAULT_DURABILITY) -> Iterator[dict[str, Any]]:
    """The remote path: the shared-memory arena off, every value over the bulk data path (service/bulk/)."""
    with grpc_backend(shared_memory=False, durability=durability) as target:
        yield target


@contextmanager
def grpc_wire_fsync_backend() -> Iterator[dict[str, Any]]:
    """``grpc-wire`` on a server that fsyncs every put before acknowledging it (``--durability fsync``)."""
    with grpc_backend(shared_memory=False, durability="fsync") as target:
        yield target


@contextmanager
def grpc_http2_backend(durability: str = DEFAULT_DURABILITY) -> Iterator[dict[str, Any]]:
    """Every byte over gRPC's HTTP/2 wire: neither the arena nor the data path (the remote path before it)."""
    with grpc_backend(shared_memory=False, data_path=False, durability=durability) as target:
        yield target


def connect(target: dict[str, Any]) -> tuple[ClientPair, Callable[[], None]]:
    """A client of ``target`` and its ``close``."""
    if target["kind"] == "lmdb":
        env = lmdb.open(target["path"], map_size=64 << 30, readahead=True, sync=False, max_readers=256)

        def put(key: bytes, value: bytes) -> None:
            with env.begin(write=True) as txn:
                txn.put(key, value)

        def get(key: bytes) -> bytes | None:
            with env.begin() as txn:
                return txn.get(key)

        return (put, get), env.close
    if target["kind"] == "disk-floor":
        return _disk_floor_client(target["path"]), lambda: None
    if target["kind"] == "redis":
        import redis

        client = redis.Redis.from_url(target["url"])
        return ((lambda k, v: client.set(k, v)), client.get), client.close
    if target["kind"] == "socket-floor":
        from kvshelf.bench.socket_floor import SocketClient

        floor = SocketClient(target["address"])
        return (floor.put, floor.get), floor.close
    if target["kind"] == "grpc-bare":
        from kvshelf.bench.grpc_bare import BareClient

        bare = BareClient(target["address"])
        return (bare.put, bare.get), bare.close
    if target["kind"] == "grpc":
        from kvshelf.service.client import RemoteStore

        remote = RemoteStore(target["address"], namespace="bench", shared_memory=target["shared_memory"],
                             data_path=target.get("data_path", True))

        def remote_get(key: bytes) -> bytes | None:
            return remote.get_encoded_many([key])[0]

        return ((lambda k, v: remote.put_encoded_many([(k, v)])), remote_get), remote.close
    raise ValueError(f"unknown backend kind {target['kind']!r}")


def ops_per_client(block_mib: int) -> int:
    """Operations per client and case: 32 for 1 and 8 MiB, 8 for 32 MiB (256 samples for a p99 at 8 clients)."""
    return max(4, min(32, 256 // block_mib))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


#: Seconds between a case's put and get phases (see ``run_case``).
SETTLE_S = 2.0

#: Untimed warm-up gets per client before the timed ops.
WARMUP_OPS = 2

#: A key no case stores: each client's untimed warm-up get misses on it.
WARMUP_KEY = hashlib.blake2b(b"bench:warm-up", digest_size=16).digest()


def bench_key(block_mib: int, clients: int, client: int, op_index: int) -> bytes:
    """The 16-byte key of one benchmark block."""
    return hashlib.blake2b(f"bench:{block_mib}:{clients}:{client}:{op_index}".encode(), digest_size=16).digest()


def client_values(block_mib: int, clients: int, client: int, ops: int) -> dict[bytes, bytes]:
    """A valid encoded block of about ``block_mib`` MiB for each of one client's keys (deterministic, so the put
    and the get process of a client build the same values; the service verifies what it stores)."""
    from kvshelf.kvstore import KVBlock, encode_block

    tokens = max(1, block_mib * MiB // (2 * 8 * 8 * 128 * 2))  # fp16 [8 layers, 8 heads, tokens, 128]
    rng = torch.Generator().manual_seed(block_mib)
    block = KVBlock(torch.randn(8, 8, tokens, 128, generator=rng).half(),
                    torch.randn(8, 8, tokens, 128, generator=rng).half(), tuple(range(tokens)), 0, "b" * 32, "bench")
    return {bench_key(block_mib, clients, client, i): encode_block(block, bench_key(block_mib, clients, client, i))
            for i in range(ops)}


def client_work(target: dict[str, Any], op: str, block_mib: int, clients: int, client: int, ops: int,
                ready: Callable[[], None]) -> dict[str, Any]:
    """One client's part of a case: connect, ``ready()`` (returns at the common start of the warm-up), untimed
    warm-up ops, ``ready()`` again (returns at the common start of the timed ops), then ``ops`` timed ops on its
    own keys, every get verified byte for byte."""
    values = client_values(block_mib, clients, client, ops)
    (put, get), close = connect(target)
    try:
        # Untimed warm-up, every backend alike, all clients at once (the server meets the case's concurrency before
        # the timed ops do: each of its threads has a heap of the size it needs, which a cold server grows during
        # its first concurrent transfers, at the speed the kernel hands out new pages): move a full-size value
        # twice (gRPC's HTTP/2 windows grow, the client's /dev/shm arena gets its pages, and the C allocator, which
        # raises its mmap threshold after the first large free, grows its heap once); the put case reads a key no
        # case stores.
        ready()
        for _ in range(WARMUP_OPS):
            get(bench_key(block_mib, clients, client, 0) if op == "get" else WARMUP_KEY)
        ready()
        latencies, errors, messages = [], 0, []
        began = time.perf_counter()
        for i in range(ops):
            key = bench_key(block_mib, clients, client, i)
            expected = values[key]
            start = time.perf_counter()
            try:
                if op == "put":
                    put(key, expected)
                else:
                    got = get(key)
                    # compared as is when it is bytes-like (a bytearray: no copy first); a memoryview is copied
                    # (comparing one with bytes goes element by element: 20 ms for 8 MiB)
                    if got is None or (got if isinstance(got, bytes | bytearray) else bytes(got)) != expected:
                        errors += 1
                        messages.append("miss" if got is None else "wrong bytes")
            except Exception as exc:
                errors += 1
                messages.append(f"{type(exc).__name__}: {exc}"[:300])
            latencies.append(time.perf_counter() - start)
        return {"latencies": latencies, "errors": errors, "error_messages": sorted(set(messages))[:5],
                "began": began, "ended": time.perf_counter(),
                "bytes": sum(len(v) for v in values.values())}
    finally:
        close()


def _run_op(target: dict[str, Any], op: str, block_mib: int, clients: int, ops: int) -> dict[str, Any]:
    """One phase of a case with ``clients`` worker processes (``python -m bench.store_worker``) that start their
    warm-up together once all are connected, and their timed ops together once all are warm; lines over their
    pipes."""
    spec = {"target": target, "op": op, "block_mib": block_mib, "clients": clients, "ops": ops}
    # every client process, whatever its backend, with glibc's large-buffer settings (service/allocator.py: without
    # them each 8 MiB value a client receives is a freshly faulted mapping, which costs about as much as moving it),
    # so the table compares the backends, not the allocator's state; kvshelf serve sets them for itself
    env = {**os.environ, "GLIBC_TUNABLES": LARGE_BUFFER_TUNABLES}
    workers = [subprocess.Popen([sys.executable, "-m", "kvshelf.bench.store_worker", json.dumps({**spec, "client": c})],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
               for c in range(clients)]
    try:
        for _ in ("warm-up", "timed ops"):  # two common starts
            for w in workers:
                line = w.stdout.readline() if w.stdout else ""
                if line.strip() != "ready":
                    raise RuntimeError(f"bench store worker failed to start (exit {w.poll()}): {line.strip()!r}")
            for w in workers:  # the common start: every worker is blocked reading this line
                assert w.stdin is not None
                w.stdin.write("go\n")
                w.stdin.flush()
        reports = []
        for w in workers:
            out, _ = w.communicate(timeout=WORKER_TIMEOUT_S)
            if w.returncode != 0:
                raise RuntimeError(f"bench store worker exited with {w.returncode}")
            reports.append(json.loads(out))
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    flat = [x for r in reports for x in r["latencies"]]
    wall = max(r["ended"] for r in reports) - min(r["began"] for r in reports)  # CLOCK_MONOTONIC: system-wide
    return {
        "op": op, "block_mib": block_mib, "clients": clients,
        "mb_s": round(sum(r["bytes"] for r in reports) / wall / 1e6, 1),
        "p50_ms": round(1000 * statistics.median(flat), 2), "p99_ms": round(1000 * _percentile(flat, 99), 2),
        "errors": sum(r["errors"] for r in reports),
        "error_messages": sorted({m for r in reports for m in r.get("error_messages", [])})[:5],
    }


def run_case(target: dict[str, Any], block_mib: int, clients: int, ops: int, settle_s: float = SETTLE_S) -> list[dict]:
    """Each client puts ``ops`` distinct blocks, then gets them back and verifies them byte for byte."""
    put = _run_op(target, "put", block_mib, clients, ops)
    # Every backend alike: let the put phase's after-effects settle (the kernel writing back dirty pages, the
    # allocator returning memory) so the get phase measures reads, not the tail of the writes before them:
    # dirty pages are written back now (os.sync), not by the kernel's flusher in the middle of the gets.
    if settle_s > 0:
        os.sync()
        time.sleep(settle_s)
    return [put, _run_op(target, "get", block_mib, clients, ops)]


BACKENDS: dict[str, Backend] = {"grpc": grpc_backend, "grpc-wire": grpc_wire_backend,
                                "grpc-wire-fsync": grpc_wire_fsync_backend, "grpc-http2": grpc_http2_backend,
                                "grpc-bare": grpc_bare_backend, "socket-floor": socket_floor_backend,
                                "disk-floor": disk_floor_backend, "redis": redis_backend, "lmdb": lmdb_backend}
#: the backends whose server takes ``--durability``
DURABLE_BACKENDS = frozenset({"grpc", "grpc-wire", "grpc-http2"})


def chosen_backends(names: Iterable[str], durability: str = DEFAULT_DURABILITY) -> dict[str, Backend]:
    """``BACKENDS`` of ``names``, the kvshelf ones with the server's ``durability``."""
    return {name: functools.partial(BACKENDS[name], durability=durability) if name in DURABLE_BACKENDS
            else BACKENDS[name] for name in names}


def add_redis_ratios(results: list[dict[str, Any]]) -> None:
    """``vs_redis``: each row's MB/s over raw redis-py's for the same op, block size and clients (same run)."""
    redis_rows = {(r["op"], r["block_mib"], r["clients"]): r["mb_s"] for r in results if r["backend"] == "redis"}
    for r in results:
        anchor = redis_rows.get((r["op"], r["block_mib"], r["clients"]))
        r["vs_redis"] = round(r["mb_s"] / anchor, 2) if anchor else None


def run(
    *, json_path: str | None, backends: dict[str, Backend] = BACKENDS, sizes: tuple[int, ...] = DEFAULT_SIZES,
    clients: tuple[int, ...] = DEFAULT_CLIENTS, console: Console | None = None, settle_s: float = SETTLE_S,
    durability: str = DEFAULT_DURABILITY, ops: int | None = None,
) -> dict[str, Any]:
    """Every backend at every size and client count; ``ops``: operations per client and case (default
    ``ops_per_client``: enough samples for a p99)."""
    console = console or Console()
    if "redis" in backends:
        binary("redis-server")  # fail before minutes of other backends, not after them
    results = []
    for name, backend in backends.items():
        with backend() as target:
            for block_mib in sizes:
                for n in clients:
                    count = ops or ops_per_client(block_mib)
                    console.print(f"[dim]{name}: {block_mib} MiB x {n} client(s) x {count} ops[/dim]")
                    for row in run_case(target, block_mib, n, count, settle_s):
                        results.append({"backend": name, **row})
    add_redis_ratios(results)
    payload = {"machine": machine_description(), "results": results,
               "client_env": {"GLIBC_TUNABLES": LARGE_BUFFER_TUNABLES},
               "durability": durability,
               "note": "grpc: a same-host client's default (gets through a /dev/shm arena, puts over the data path); "
                       "grpc-wire: a remote client's default, every value over the bulk data path (service/bulk/); "
                       "grpc-wire-fsync: the same with an fsync per put; grpc-http2: every byte over gRPC/HTTP/2 on "
                       "loopback; socket-floor: a bare Python socket server (the remote path's limit); disk-floor: "
                       "each value pwritten to a new file, no fsync (the limit of a store that writes values to "
                       "files: on this VM, pages new to the page cache cost 20-25 ms per 8 MiB at times); "
                       "the kvshelf servers run with --durability as given (grpc-wire-fsync: fsync); "
                       "vs_redis: MB/s over raw redis-py's in this run"}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"store throughput ({payload['machine']})")
    for col in ("backend", "op", "block MiB", "clients", "MB/s", "vs redis", "p50 ms", "p99 ms", "p99/p50", "errors"):
        table.add_column(col, justify="right")
    for r in payload["results"]:
        ratio = f"{r['vs_redis']:.2f}x" if r["vs_redis"] is not None else "-"
        table.add_row(r["backend"], r["op"], str(r["block_mib"]), str(r["clients"]), f"{r['mb_s']:.0f}", ratio,
                      f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['p99_ms'] / r['p50_ms']:.1f}", str(r["errors"]))
    return table
