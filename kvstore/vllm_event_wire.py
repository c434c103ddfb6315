"""vLLM's KV-event wire (``vllm/distributed/kv_events.py`` at ``VLLM_VERSION``): the msgspec event types, the
publisher's settings, endpoints and block hashes; shared by the publisher (``kvstore.vllm_events``, whose module doc
describes the stream) and the process that owns its sockets (``kvstore.vllm_events_worker``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import key_low64

#: the vLLM release whose ``kv_events.py`` this wire follows
VLLM_VERSION = "0.28.0"
#: the replay stream's end marker (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: tier type name -> ``medium`` (the names vLLM's GPU cache and offloading connectors use, DISK and REMOTE beside)
MEDIA = {"MemoryTier": "CPU", "GPUTier": "GPU", "LMDBTier": "DISK", "RedisTier": "REMOTE"}
#: events encoded into one batch at most
MAX_BATCH_EVENTS = 1024
#: records sent to the publisher process in one message at most (a partial batch waits ``FEED_WINDOW_S``)
FEED_BATCH = 256
#: how long a partial batch of records waits before the feed thread sends it
FEED_WINDOW_S = 0.05
#: default byte bound of the replay buffer (``buffer_bytes``)
BUFFER_BYTES = 64 << 20
_ENDPOINT = re.compile(r"(tcp)://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})|(ipc|inproc)://.+")


# -- the wire: vLLM's structs, declared from its field list ---------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One KV cache event (a map tagged ``"type"``: the class name)."""


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


# -- settings ------------------------------------------------------------------------------------------------------


def parse_endpoint(endpoint: str, setting: str) -> tuple[str, bool]:
    """``(endpoint, binds)`` for a ZeroMQ endpoint, by vLLM's convention; ``ConfigError`` naming ``setting``."""
    match = _ENDPOINT.fullmatch(endpoint)
    if not match or (match.group(3) is not None and not 0 < int(match.group(3)) < 65536):
        raise ConfigError(f"{setting}: cannot read endpoint {endpoint!r}; use tcp://*:PORT (bind), "
                          "tcp://HOST:PORT (connect), ipc://PATH or inproc://NAME")
    binds = match.group(4) is not None or match.group(2) == "*" or "::" in (match.group(2) or "")
    return endpoint, binds


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` names a bracketed IPv6 host (``tcp://[::1]:PORT``): its socket needs ``ZMQ_IPV6``."""
    return endpoint.startswith("tcp://[")


@dataclass(frozen=True)
class KVEventsSettings:
    """Where and how vLLM-format KV events are published (vLLM's ``KVEventsConfig`` fields, kvshelf's beside).

    ``namespaces``: only these namespaces' events are published (None: every namespace): with one namespace per
    endpoint, another tenant's events never reach its subscribers. ``buffer_bytes``: payload bytes kept for replay
    (beside ``buffer_steps`` batches; also the bound of payloads out of the buffer still queued for a peer).
    ``handshake_s``: a peer that has not finished the ZeroMQ handshake by then is dropped."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    block_hashes: Literal["int", "bytes"] = "int"
    namespaces: frozenset[str] | None = None
    data_parallel_rank: int = 0
    buffer_bytes: int = BUFFER_BYTES
    handshake_s: float = 3.0

    def check(self) -> None:
        parse_endpoint(self.endpoint, "kv_events_endpoint")
        if self.replay_endpoint:
            _, binds = parse_endpoint(self.replay_endpoint, "kv_events_replay_endpoint")
            if not binds and not self.replay_endpoint.startswith("tcp://"):
                raise ConfigError(f"kv_events_replay_endpoint: {self.replay_endpoint!r} must be one to bind")
        for name in ("buffer_steps", "buffer_bytes", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_events_{name}: must be >= 1, got {getattr(self, name)}")
        if not self.handshake_s > 0:
            raise ConfigError(f"kv_events_handshake_s: must be > 0, got {self.handshake_s}")
        if self.block_hashes not in ("int", "bytes"):
            raise ConfigError(f"kv_events_block_hashes: {self.block_hashes!r} is not 'int' or 'bytes'")


# -- the publisher -------------------------------------------------------------------------------------------------


def block_hasher(form: Literal["int", "bytes"]) -> Callable[[bytes], int | bytes]:
    """How a block key becomes vLLM's ``ExternalBlockHash``: its low 64 bits big-endian (``int``) or its bytes."""
    return key_low64 if form == "int" else bytes


def medium_of(tier: Any) -> str:
    """The ``medium`` of a tier (``MEDIA`` by its type; else its name upper-cased)."""
    for cls in type(tier).__mro__:
        if cls.__name__ in MEDIA:
            return MEDIA[cls.__name__]
    return str(getattr(tier, "name", "?")).upper()


def open_socket(socket: zmq.Socket, endpoint: str, setting: str, *, bind: bool | None = None) -> None:
    """Bind or connect ``socket`` to ``endpoint`` by vLLM's convention (``bind``: always bind); ``ConfigError``
    naming ``setting`` when it cannot."""
    _, binds = parse_endpoint(endpoint, setting)
    if is_ipv6(endpoint):
        socket.setsockopt(zmq.IPV6, 1)
    try:
        if binds or bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        reason = "address already in use" if exc.errno == zmq.EADDRINUSE else str(exc)
        raise ConfigError(f"{setting}: cannot {'bind' if binds or bind else 'connect'} {endpoint!r}: "
                          f"{reason}") from None
