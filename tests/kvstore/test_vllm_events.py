"""vLLM-format KV events over ZeroMQ (kvstore/vllm_events.py), read by a subscriber written from vLLM's published
schema: the msgspec structs below are declared here from the field list of ``vllm/distributed/kv_events.py`` at
vLLM 0.28.0, not imported from kvshelf. A real embedded store (memory over LMDB), real ZeroMQ sockets on loopback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import vllm_schema
import zmq
from helpers import make_block
from service_helpers import free_port
from vllm_schema import (
    DECODER,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    receive,
    subscriber,
)

from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import prefix_block_keys
from kvshelf.kvstore.vllm_events import VLLM_VERSION, KVEventsSettings, VLLMEventPublisher

ctx = vllm_schema.ctx


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


def dealer_replay(ctx: zmq.Context, port: int, start: int, *frames: bytes) -> list[tuple[int, bytes]]:
    """vLLM's own subscriber example reads the replay with a DEALER sending ``(b"", start)``: same here."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big"), *frames])
        out = []
        while True:
            assert dealer.poll(5000), "the replay endpoint did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


FP = "fp-vllm-events"


def settings(ports: tuple[int, int], **kw: Any) -> KVEventsSettings:
    return KVEventsSettings(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}", **kw)


def chain(tokens: list[int], block: int = 4, namespace: str = "default") -> list[tuple[bytes, Any]]:
    """``(key, block)`` of a prompt's full blocks, each naming its parent key as the generate adapter does."""
    keys = prefix_block_keys(FP, namespace, tokens, block)
    out, parent = [], b""
    for i, key in enumerate(keys):
        extra = {"parent": parent.hex()} if parent else None
        out.append((key, make_block(tokens[i * block:(i + 1) * block], fingerprint=FP, namespace=namespace,
                                    start_pos=i * block, extra=extra)))
        parent = key
    return out


def low64(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


# -- the stream ----------------------------------------------------------------------------------------------------


def test_a_vllm_schema_subscriber_decodes_stored_removed_evicted_and_cleared(
        ctx: zmq.Context, tmp_path: Path, ports: tuple[int, int]) -> None:
    sub = subscriber(ctx, ports[0])
    store = open_embedded_store(tmp_path, memory_bytes="8KiB", max_disk_bytes="8MiB")
    with store, VLLMEventPublisher(settings(ports, topic="kv@"), context=ctx).attach(store) as pub:
        time.sleep(0.2)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
        entries = chain(list(range(100, 140)))  # ten 4-token blocks of one prompt, stored block by block
        for entry in entries:
            store.put_many([entry])
        store.delete([entries[-1][0]])
        pub.cleared("default")
        assert pub.flush()
        messages = receive(sub, pub.next_seq)
        assert pub.stats()["queue_drops"] == pub.stats()["hwm_drops"] == 0
    assert all(topic == b"kv@default" for topic, _, _ in messages)
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    events = [e for _, _, batch in messages for e in batch.events]
    assert all(batch.data_parallel_rank == 0 for _, _, batch in messages)
    keys = [key for key, _ in entries]
    stored = [e for e in events if isinstance(e, BlockStored)]
    for medium in ("CPU", "DISK"):  # memory over LMDB: every block stored in both
        chain_events = [e for e in stored if e.medium == medium]
        assert [e.block_hashes for e in chain_events] == [[low64(k)] for k in keys]
        assert [e.parent_block_hash for e in chain_events] == [None] + [low64(k) for k in keys[:-1]]
        assert [e.token_ids for e in chain_events] == [list(range(100 + 4 * i, 104 + 4 * i)) for i in range(10)]
    assert {(e.block_size, e.lora_id, e.lora_name, e.group_idx) for e in stored} == {(4, None, None, 0)}
    removed = [(e.block_hashes, e.medium) for e in events if isinstance(e, BlockRemoved)]
    # an 8 KiB memory tier holds a few blocks: the oldest are evicted from CPU; the delete removes the last from both
    evicted = removed[:-2]
    assert evicted and all(medium == "CPU" for _, medium in evicted)
    assert {h for hashes, _ in evicted for h in hashes} < {low64(k) for k in keys[:-1]}
    assert removed[-2:] == [([low64(keys[-1])], "CPU"), ([low64(keys[-1])], "DISK")]
    assert isinstance(events[-1], AllBlocksCleared)


def test_replay_after_a_subscriber_restart_has_no_gap_and_no_duplicate(
        ctx: zmq.Context, tmp_path: Path, ports: tuple[int, int]) -> None:
    store = open_embedded_store(tmp_path, memory_bytes=None, max_disk_bytes="8MiB")
    with store, VLLMEventPublisher(settings(ports), context=ctx).attach(store) as pub:
        sub = subscriber(ctx, ports[0])
        time.sleep(0.2)
        store.put_many(chain(list(range(0, 16)))[:2])
        assert pub.flush()
        seen = receive(sub, pub.next_seq)
        last = seen[-1][1]
        sub.close(linger=0)  # the subscriber goes away; events go on meanwhile
        store.put_many(chain(list(range(200, 216)))[:3])
        assert pub.flush()
        sub = subscriber(ctx, ports[0])  # back: it asks for everything after the last sequence it saw
        time.sleep(0.2)
        missed = dealer_replay(ctx, ports[1], last + 1)
        store.put_many(chain(list(range(400, 408)))[:1])  # and a live one after the replay
        assert pub.flush()
        live = receive(sub, pub.next_seq)
        sub.close(linger=0)
    seqs = [seq for _, seq, _ in seen] + [seq for seq, _ in missed] + [seq for _, seq, _ in live]
    assert seqs == list(range(len(seqs)))  # no gap, no duplicate
    tokens = [e.token_ids for seq, payload in missed for e in DECODER.decode(payload).events]
    assert tokens == [list(range(200 + 4 * i, 204 + 4 * i)) for i in range(3)]


def test_replay_of_a_sequence_already_gone_sends_what_is_left_then_the_end_marker(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports, buffer_steps=3), context=ctx) as pub:
        for i in range(6):  # six batches (one per flush), the buffer keeps the last three
            pub.removed("default", bytes([i]) * 16, "CPU")
            assert pub.flush()
        got = dealer_replay(ctx, ports[1], 0)
        assert [seq for seq, _ in got] == [3, 4, 5]
        assert [DECODER.decode(p).events[0].block_hashes for _, p in got] == [[low64(bytes([i]) * 16)]
                                                                              for i in (3, 4, 5)]
        assert dealer_replay(ctx, ports[1], 99) == []  # past the end: the end marker alone
        # a REQ client (vLLM's example uses one) gets its answer too
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{ports[1]}")
        req.send((5).to_bytes(8, "big"))
        assert req.poll(5000)
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 5 and DECODER.decode(payload).events
        req.close(linger=0)


def documented_replay_client() -> Any:
    """The ``replay`` function of the replay client in docs/serving.md, as written there."""
    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    block = next(b for b in page.split("```python\n")[1:] if "def replay(" in b).split("```")[0]
    namespace: dict[str, Any] = {}
    exec(compile(block.split("\nports = []")[0], "docs/serving.md", "exec"), namespace)
    return namespace["replay"]


def test_the_documented_replay_client_gets_every_batch_and_the_end_marker(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    replay = documented_replay_client()
    with VLLMEventPublisher(settings(ports), context=ctx) as pub:
        for i in range(1500):
            pub.removed("default", i.to_bytes(16, "big"), "CPU")
            assert pub.flush()
        batches = replay(ctx, f"tcp://127.0.0.1:{ports[1]}", 0, b"default")  # returns at the end marker only
    assert [seq for seq, _ in batches] == list(range(1500))
    assert [batch.events[0].block_hashes for _, batch in batches[-2:]] == [[1498], [1499]]


def test_a_malformed_replay_request_gets_the_end_marker_and_is_counted(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports), context=ctx) as pub:
        pub.cleared("default")
        assert pub.flush()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        for bad in ([b"", b"abc"], [b"", b"12345678", b"topic", b"extra"], [b""]):
            dealer.send_multipart(bad)
            assert dealer.poll(5000)
            assert dealer.recv_multipart() == [b"", END_SEQ, b""]
        dealer.close(linger=0)
        assert pub.stats()["bad_replay_requests"] == 3
        assert len(dealer_replay(ctx, ports[1], 0)) == 1  # the endpoint still serves good requests


def test_each_namespace_is_its_own_topic_and_a_filter_keeps_other_tenants_out(
        ctx: zmq.Context, tmp_path: Path, ports: tuple[int, int]) -> None:
    only_a = settings(ports, topic="kv.", namespaces=frozenset({"tenant-a"}))
    with VLLMEventPublisher(only_a, context=ctx) as pub:
        sub = subscriber(ctx, ports[0])  # every topic
        time.sleep(0.2)
        pub.removed("tenant-b", b"\x01" * 16, "CPU")
        pub.removed("tenant-a", b"\x02" * 16, "CPU")
        assert pub.flush()
        (topic, _, batch), = receive(sub, pub.next_seq)
        assert topic == b"kv.tenant-a" and batch.events[0].block_hashes == [low64(b"\x02" * 16)]
        # replay with a topic prefix (kvshelf's extension) gives that topic only
        assert len(dealer_replay(ctx, ports[1], 0, b"kv.tenant-a")) == 1
        assert dealer_replay(ctx, ports[1], 0, b"kv.tenant-b") == []
        sub.close(linger=0)


def test_block_hashes_as_bytes(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports, block_hashes="bytes"), context=ctx) as pub:
        sub = subscriber(ctx, ports[0])
        time.sleep(0.2)
        pub.stored("default", b"\x07" * 16, b"\x06" * 16, (1, 2, 3), "DISK")
        assert pub.flush()
        (_, _, batch), = receive(sub, pub.next_seq)
        sub.close(linger=0)
    event = batch.events[0]
    assert event.block_hashes == [b"\x07" * 16] and event.parent_block_hash == b"\x06" * 16


def test_a_subscriber_that_never_reads_is_dropped_at_its_hwm_and_others_get_everything(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports, hwm=4), context=ctx) as pub:
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.connect(f"tcp://127.0.0.1:{ports[0]}")
        reader = subscriber(ctx, ports[0])
        time.sleep(0.3)
        tokens = tuple(range(8192))  # ~24 KiB batches, ~14 MiB in all: past any socket buffer of the stuck one
        received = []
        for i in range(600):
            pub.stored("default", i.to_bytes(16, "big"), b"", tokens, "CPU")
            if i % 20 == 19:
                assert pub.flush()
                received += receive(reader, pub.next_seq)
        stats = pub.stats()
        assert stats["hwm_drops"] > 0 and stats["queue_drops"] == 0
        assert [seq for _, seq, _ in received] == list(range(pub.next_seq))
        stuck.close(linger=0)
        reader.close(linger=0)


def test_a_full_queue_drops_and_counts_instead_of_blocking(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports, max_queue_size=1), context=ctx) as pub:
        for i in range(2000):  # faster than the thread drains a one-slot queue
            pub.removed("default", i.to_bytes(16, "big"), "CPU")
        assert pub.flush()
        stats = pub.stats()
        assert stats["queue_drops"] > 0
        assert stats["queue_drops"] + stats["published_events"] == 2000


# -- the golden bytes ------------------------------------------------------------------------------------------------

#: one batch per event type, encoded by vLLM 0.28.0's schema with msgspec (ts fixed): the bytes a vLLM router reads
GOLDEN = {
    "stored": (
        "93cb41da3054981000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf01020304"
        "05060708b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739301cd0100ce00010000aa626c6f63"
        "6b5f73697a6503a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f696478"
        "0000"
    ),
    "removed": (
        "93cb41da3054981000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfffffff"
        "ffffffffffa66d656469756da44449534ba967726f75705f6964780000"
    ),
    "cleared": (
        "93cb41da3054981000009181a474797065b0416c6c426c6f636b73436c656172656400"
    ),
}


def golden_batches() -> dict[str, Any]:
    return {
        "stored": KVEventBatch(ts=1757500000.25, data_parallel_rank=0, events=[BlockStored(
            block_hashes=[0x0102030405060708], parent_block_hash=None, token_ids=[1, 256, 65536], block_size=3,
            lora_id=None, medium="CPU", lora_name=None, group_idx=0)]),
        "removed": KVEventBatch(ts=1757500000.25, data_parallel_rank=0, events=[BlockRemoved(
            block_hashes=[0xFFFFFFFFFFFFFFFF], medium="DISK", group_idx=0)]),
        "cleared": KVEventBatch(ts=1757500000.25, data_parallel_rank=0, events=[AllBlocksCleared()]),
    }


@pytest.mark.parametrize("kind", ["stored", "removed", "cleared"])
def test_golden_bytes_of_each_event_type(
        ctx: zmq.Context, kind: str, monkeypatch: pytest.MonkeyPatch, ports: tuple[int, int]) -> None:
    assert VLLM_VERSION == "0.28.0"
    expected = msgspec.msgpack.encode(golden_batches()[kind])
    monkeypatch.setattr("kvshelf.kvstore.vllm_events.time.time", lambda: 1757500000.25)
    with VLLMEventPublisher(settings(ports), context=ctx) as pub:
        sub = subscriber(ctx, ports[0])
        time.sleep(0.2)
        if kind == "stored":
            pub.stored("default", bytes(8) + bytes(range(1, 9)), b"", (1, 256, 65536), "CPU")
        elif kind == "removed":
            pub.removed("default", b"\xff" * 16, "DISK")
        else:
            pub.cleared("default")
        assert pub.flush()
        topic, seq, payload = sub.recv_multipart()
        sub.close(linger=0)
    assert (topic, seq) == (b"default", bytes(8))
    assert payload == expected
    assert payload.hex() == GOLDEN[kind]


# -- bad settings ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://nohost", "http://x:1", "tcp://*:0", "tcp://*:70000", "", "tcp://*:x"])
def test_an_unreadable_endpoint_is_a_config_error_naming_it(ctx: zmq.Context, endpoint: str) -> None:
    with pytest.raises(ConfigError, match="kv_events_endpoint: cannot read endpoint"):
        VLLMEventPublisher(KVEventsSettings(endpoint=endpoint))


def test_an_endpoint_in_use_is_a_config_error(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with VLLMEventPublisher(settings(ports), context=ctx):
        with pytest.raises(ConfigError, match="address already in use"):
            VLLMEventPublisher(KVEventsSettings(endpoint=f"tcp://*:{ports[0]}"), context=ctx)
        with pytest.raises(ConfigError, match="kv_events_replay_endpoint: .* address already in use"):
            VLLMEventPublisher(KVEventsSettings(endpoint=f"tcp://*:{free_port()}",
                                                replay_endpoint=f"tcp://*:{ports[1]}"), context=ctx)


def test_bench_kv_events_delivers_every_event_to_a_subscriber_process(tmp_path: Path) -> None:
    import io
    import json

    from rich.console import Console

    from kvshelf.bench.kv_events import run

    payload = run(json_path=str(tmp_path / "kv_events.json"), puts=300, rounds=1, console=Console(file=io.StringIO()))
    assert payload["events_published"] == payload["events_received"] == 300 and payload["dropped"] == 0
    assert json.loads((tmp_path / "kv_events.json").read_text())["puts"] == 300
    assert payload["publisher_cpu_us_per_event"] > 0


def test_the_publisher_process_stops_with_the_publisher_and_a_dead_one_never_blocks_puts(
        ctx: zmq.Context, ports: tuple[int, int], tmp_path: Path) -> None:
    pub = VLLMEventPublisher(settings(ports, max_queue_size=256), context=ctx)
    proc, folder = pub._proc, pub._folder
    assert proc.poll() is None and folder.is_dir()
    pub.close()
    assert proc.poll() is not None and not folder.exists()  # the process is gone, its folder removed
    store = open_embedded_store(tmp_path, durable=False, kv_events=settings((free_port(), free_port()),
                                                                              max_queue_size=256))
    try:
        publisher_process = store._closers[0].__self__._proc  # the publisher the store closes (its close method)
        publisher_process.kill()
        publisher_process.wait(10)
        entries = chain(list(range(4 * 600)))
        for entry in entries:  # the feed fills, then drops: puts go on
            store.put_many([entry])
        assert store.lookup_prefix([k for k, _ in entries], model=FP) == len(entries)
    finally:
        store.close()
