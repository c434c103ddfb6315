"""`kvshelf bench store` end to end at its smallest: real `kvshelf serve`, real redis-server, real LMDB."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvshelf.bench.store import BACKENDS, run

pytestmark = pytest.mark.slow  # a whole benchmark run: scheduled first (tests/conftest.py)


def test_bench_store_small_run_writes_its_schema(tmp_path):
    out = tmp_path / "store.json"
    payload = run(json_path=str(out), backends=BACKENDS, sizes=(1,), clients=(2,), console=Console(quiet=True),
                  settle_s=0.0, ops=4)
    rows = json.loads(out.read_text())["results"]
    assert rows == payload["results"]
    assert {(r["backend"], r["op"], r["clients"]) for r in rows} == {
        (b, op, c) for b in BACKENDS for op in ("put", "get") for c in (2,)}
    for r in rows:
        assert r["errors"] == 0, r  # every get was verified byte for byte
        assert r["mb_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["block_mib"] == 1
        assert (r["vs_redis"] == 1.0) if r["backend"] == "redis" else r["vs_redis"] > 0


def test_socket_floor_round_trips_values_and_misses() -> None:
    from kvshelf.bench.socket_floor import SocketClient, serve

    listener, port = serve()
    client = SocketClient(f"127.0.0.1:{port}")
    try:
        value = bytes(range(256)) * (3 << 12)  # 3 MiB, over many recv_into calls
        client.put(b"k" * 16, value)
        client.put(b"e" * 16, b"")
        assert client.get(b"k" * 16) == value and client.get(b"e" * 16) == b""
        assert client.get(b"x" * 16) is None
        client.put(b"k" * 16, b"smaller")  # a later, smaller get reuses the buffer and returns only its bytes
        assert bytes(client.get(b"k" * 16)) == b"smaller"
    finally:
        client.close()
        listener.close()


def test_disk_floor_round_trips_values_and_misses(tmp_path) -> None:
    from kvshelf.bench.store import connect

    (put, get), close = connect({"kind": "disk-floor", "path": str(tmp_path)})
    try:
        value = bytes(range(256)) * (3 << 12)
        put(b"k" * 16, value)
        put(b"e" * 16, b"")
        assert get(b"k" * 16) == value and get(b"e" * 16) == b""
        assert get(b"x" * 16) is None
        put(b"k" * 16, b"smaller")  # a rewrite replaces the value whole
        assert get(b"k" * 16) == b"smaller"
    finally:
        close()



def test_a_client_warms_up_after_the_first_common_start_and_times_after_the_second(tmp_path, monkeypatch) -> None:
    """The warm-up runs at the case's concurrency (all clients released together), the timed ops after a second
    common start: a client whose warm-up ran before the others connected would leave the server cold for them."""
    import time

    from kvshelf.bench import store

    target = {"kind": "disk-floor", "path": str(tmp_path)}
    (put, _), close = store.connect(target)
    for key, value in store.client_values(1, 1, 0, 2).items():
        put(key, value)
    close()
    events: list[tuple[str, float]] = []  # ("ready" | "get", when), in order
    real_connect = store.connect

    def observed(t: dict) -> tuple:  # the real disk-floor client, its gets noted
        (put, get), close = real_connect(t)

        def get_observed(key: bytes):
            events.append(("get", time.perf_counter()))
            return get(key)

        return (put, get_observed), close

    monkeypatch.setattr(store, "connect", observed)
    report = store.client_work(target, "get", 1, 1, 0, 2, lambda: events.append(("ready", time.perf_counter())))
    kinds = [kind for kind, _ in events]
    assert kinds == ["ready"] + ["get"] * store.WARMUP_OPS + ["ready", "get", "get"]
    second_start = events[1 + store.WARMUP_OPS][1]
    assert report["began"] >= second_start and report["errors"] == 0
