"""A subscriber of vLLM-format KV events written from vLLM's published schema: the msgspec structs of
``vllm/distributed/kv_events.py`` at vLLM 0.28.0, declared here from its field list (not imported from kvshelf),
and the ZeroMQ reading of its stream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

# -- vLLM 0.28.0's schema ---------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context of the test's own: every socket left open is closed with it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscriber(ctx: zmq.Context, port: int, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def wait_for(sub: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[tuple[bytes, Any]]:
    """``(topic, event)`` of the events that arrive until ``count`` have."""
    out: list[tuple[bytes, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"only {len(out)} events arrived"
        topic, _, payload = sub.recv_multipart()
        out += [(topic, event) for event in DECODER.decode(payload).events]
    return out


def receive(sub: zmq.Socket, until: int, timeout_s: float = 5.0) -> list[tuple[bytes, int, KVEventBatch]]:
    """``(topic, seq, batch)`` messages until one with sequence ``until - 1`` arrives."""
    out: list[tuple[bytes, int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout_s
    while not out or out[-1][1] < until - 1:
        assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"no event after {len(out)} messages"
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


