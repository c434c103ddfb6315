"""``kvshelf serve --kv-events-endpoint`` and ``open_embedded_store(kv_events=...)``: vLLM-format KV events of a real
server (``serve()`` in a thread, real gRPC clients) and of the embedded store, read by a ZeroMQ subscriber with
vLLM 0.28.0's schema (declared in tests/kvstore/test_vllm_events.py); their counters in /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import vllm_schema
import zmq
from helpers import key_of, make_block
from service_helpers import InProcessServe, free_port, scrape
from vllm_schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    receive,
    subscriber,
    wait_for,
)

from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.vllm_events import KVEventsSettings
from kvshelf.service.client import RemoteStore
from kvshelf.service.serve import ServeConfig, serve

ctx = vllm_schema.ctx


def test_serve_publishes_each_tenants_puts_deletes_and_clears(serving: Callable[..., InProcessServe],
                                                              ctx: zmq.Context) -> None:
    port = free_port()
    running = serving(kv_events_endpoint=f"tcp://*:{port}", kv_events_topic="kv@")
    assert f"vLLM KV events on tcp://*:{port}" in running.line
    sub_a = subscriber(ctx, port, b"kv@tenant-a")
    everything = subscriber(ctx, port, b"")
    time.sleep(0.3)
    blocks = {ns: make_block([1, 2, 3, 4], namespace=ns) for ns in ("tenant-a", "tenant-b")}
    for ns, block in blocks.items():
        with RemoteStore(running.grpc, namespace=ns, shared_memory=False) as remote:
            assert remote.put_many([(key_of(block), block)]) == 1
    with RemoteStore(running.grpc, namespace="tenant-a", shared_memory=False) as remote:
        assert remote.delete([key_of(blocks["tenant-a"])]) == 1
        remote.clear()
    seen_a = wait_for(sub_a, 2 + 2 + 1)  # stored in memory and disk, removed from both, cleared
    assert {topic for topic, _ in seen_a} == {b"kv@tenant-a"}
    stored = [e for _, e in seen_a if isinstance(e, BlockStored)]
    low64 = int.from_bytes(key_of(blocks["tenant-a"])[-8:], "big")
    assert sorted(e.medium for e in stored) == ["CPU", "DISK"]
    assert all(e.block_hashes == [low64] and e.token_ids == [1, 2, 3, 4] and e.block_size == 4 for e in stored)
    removed = [e for _, e in seen_a if isinstance(e, BlockRemoved)]
    assert sorted(e.medium for e in removed) == ["CPU", "DISK"]
    assert isinstance(seen_a[-1][1], AllBlocksCleared)
    # the subscriber of every topic saw tenant-b's too; tenant-a's subscriber never did
    all_topics = {topic for topic, _ in wait_for(everything, 2 + 2 + 2 + 1)}
    assert all_topics == {b"kv@tenant-a", b"kv@tenant-b"}
    status, body = scrape(f"http://127.0.0.1:{running.metrics_port}/metrics")
    assert status == 200
    assert "kvshelf_kv_events_published_total 7.0" in body
    assert 'kvshelf_kv_events_dropped_total{reason="hwm"} 0.0' in body
    assert 'kvshelf_kv_events_dropped_total{reason="queue"} 0.0' in body


def test_serve_refuses_an_endpoint_in_use_before_serving(tmp_path: Path, ctx: zmq.Context) -> None:
    port = free_port()
    taken = ctx.socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    config = ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), memory="16MiB",
                                       max_disk="64MiB", kv_events_endpoint=f"tcp://*:{port}", grace=0)
    with pytest.raises(ConfigError, match=f"kv_events_endpoint: cannot bind 'tcp://\\*:{port}': address already"):
        serve(config)


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_events_endpoint": "tcp:/localhost"}, "--kv-events-endpoint: .*cannot read endpoint"),
    ({"kv_events_endpoint": "tcp://*:1", "kv_events_replay_endpoint": "udp://x"}, "--kv-events-replay-endpoint"),
    ({"kv_events_endpoint": "tcp://*:1", "kv_events_block_hashes": "hex"}, "kv_events_block_hashes must be one of"),
    ({"kv_events_endpoint": "tcp://*:1", "kv_events_hwm": "0"}, "kv_events_hwm must be >= 1"),
])
def test_bad_kv_events_settings_are_config_errors(settings: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_settings(**settings)


def test_the_embedded_store_publishes_and_closes_its_publisher(tmp_path: Path, ctx: zmq.Context) -> None:
    port = free_port()
    sub = subscriber(ctx, port)
    store = open_embedded_store(tmp_path, memory_bytes=None, kv_events=KVEventsSettings(endpoint=f"tcp://*:{port}"))
    time.sleep(0.3)
    block = make_block([5, 6, 7])
    with store:
        store.put_many([(key_of(block), block)])
        (topic, _, batch), = receive(sub, 1)
    assert topic == b"default" and batch.events[0].token_ids == [5, 6, 7] and batch.events[0].medium == "DISK"
    # closed with the store: the port is free again (ZeroMQ unbinds in its I/O thread, soon after)
    again = ctx.socket(zmq.PUB)
    deadline = time.monotonic() + 5
    while True:
        try:
            again.bind(f"tcp://*:{port}")
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the publisher's port was not released"
            time.sleep(0.05)
    again.close(linger=0)
    busy = free_port()
    taken = ctx.socket(zmq.PUB)
    taken.bind(f"tcp://*:{busy}")
    with pytest.raises(ConfigError, match="address already in use"):
        open_embedded_store(tmp_path / "b", memory_bytes=None, kv_events=KVEventsSettings(endpoint=f"tcp://*:{busy}"))
    assert not (tmp_path / "b" / "lmdb").exists()  # refused before anything was opened


def metric_value(body: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, as the exposition writes them) in a scrape's ``body``."""
    (line,) = [line for line in body.splitlines() if line.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_show_the_publishers_bounds_counters(serving: Callable[..., InProcessServe], ctx: zmq.Context) -> None:
    """Replays refused, socket resets, guard drops and the bytes buffered and pinned are scraped from /metrics: a
    SUB peer past the subscription bytes' bound resets the XPUB, and a stored block is buffered for replay."""
    port, replay_port = free_port(), free_port()
    running = serving(kv_events_endpoint=f"tcp://*:{port}", kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    sub = subscriber(ctx, port, b"default")
    time.sleep(0.3)
    block = make_block([1, 2, 3, 4])
    with RemoteStore(running.grpc, shared_memory=False) as remote:
        assert remote.put_many([(key_of(block), block)]) == 1
    wait_for(sub, 2)  # stored in memory and on disk
    flood = ctx.socket(zmq.SUB)  # 20 distinct subscriptions of 4,000 bytes: past the 64 KiB the XPUB keeps
    flood.setsockopt(zmq.LINGER, 0)
    for i in range(20):
        flood.setsockopt(zmq.SUBSCRIBE, i.to_bytes(4, "big") * 1000)
    flood.connect(f"tcp://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    deadline = time.monotonic() + 10
    while True:
        status, body = scrape(url)
        assert status == 200
        if metric_value(body, "kvshelf_kv_events_socket_resets_total") >= 1:
            break
        assert time.monotonic() < deadline, "no socket reset in /metrics after 80 KB of subscriptions"
        time.sleep(0.1)
    assert metric_value(body, "kvshelf_kv_events_buffer_bytes") > 0
    assert metric_value(body, "kvshelf_kv_events_pinned_bytes") >= 0
    assert metric_value(body, "kvshelf_kv_events_guard_drops_total") == 0
    assert metric_value(body, 'kvshelf_kv_events_replays_total{result="refused"}') == 0
    flood.close(linger=0)
    sub.close(linger=0)
