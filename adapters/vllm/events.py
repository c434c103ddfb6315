"""The connector's KV events: what the store does with the connector's blocks, as vLLM ``KVCacheEvent``s.

The worker role subscribes to its store (a ``TieredStore``: the embedded store, Redis) and turns each event of its
namespace into vLLM's ``BlockStored`` (a tier stored a block: a save, a promotion on a read, a write-down) or
``BlockRemoved`` (a block left a tier: an eviction, a damaged value dropped), the same events ``kvshelf serve``
and ``kvstore.vllm_events`` publish over ZeroMQ: block hashes are kvshelf's block keys as their low 64 bits
(``kvstore.keys.key_low64``, vLLM's int form), ``parent_block_hash`` the chain's previous key, ``medium`` the tier
(``kvstore.vllm_events.MEDIA``: ``CPU``, ``DISK``, ``REMOTE``). The worker hands them to the scheduler with each
step's output (``KVShelfKVEvents``); the scheduler's ``take_events`` gives them to vLLM's KV event publisher, which
sends them with vLLM's own prefix-cache events when ``--kv-events-config`` enables it.

A ``RemoteStore`` (``grpc://``) has no events here: the server publishes its tiers' events itself
(``kvshelf serve --kv-events``, ``SubscribeEvents``). Events wait in a bounded buffer (``max_events``): past it
the oldest are dropped and counted (``dropped``), so a scheduler that stops stepping never grows the worker's
memory.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvshelf.kvstore.keys import key_low64, parent_of
from kvshelf.kvstore.stats import UNKNOWN, StoreEvent

#: events one worker keeps between two engine steps at most
MAX_EVENTS = 10_000


class KVShelfKVEvents(KVConnectorKVEvents):
    """The events one step's worker output carries (one worker: the connector refuses tensor parallelism)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events = list(events or ())
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVShelfKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class StoreEventCollector:
    """Collects ``store``'s events of ``namespace`` as vLLM events until ``take``; ``close`` unsubscribes. A store
    without ``subscribe`` (``RemoteStore``) yields none."""

    def __init__(self, store: Any, namespace: str, max_events: int = MAX_EVENTS) -> None:
        from kvshelf.kvstore.vllm_events import medium_of

        self.namespace = namespace
        self.dropped = 0
        self._events: deque[KVCacheEvent] = deque()
        self._max = max_events
        self._lock = threading.Lock()
        self._media = {spec.tier.name: medium_of(spec.tier) for spec in getattr(store, "specs", ())}
        subscribe = getattr(store, "subscribe", None)
        self._unsubscribe = subscribe(self._on_event) if subscribe is not None and self._media else None

    def _on_event(self, event: StoreEvent) -> None:
        if event.namespace != self.namespace and not (event.kind == "removed" and event.namespace == UNKNOWN):
            return  # another namespace's (a removal may not know its block's namespace: forgetting it is harmless)
        medium = self._media.get(event.tier, event.tier.upper())
        block = key_low64(event.key)
        converted: KVCacheEvent
        if event.kind == "stored":
            header = event.header
            tokens = list(header.token_ids) if header is not None else []
            parent = parent_of(header.extra) if header is not None else b""
            converted = BlockStored(block_hashes=[block], parent_block_hash=key_low64(parent) if parent else None,
                                    token_ids=tokens, block_size=len(tokens), lora_id=None, medium=medium,
                                    lora_name=None)
        else:
            converted = BlockRemoved(block_hashes=[block], medium=medium)
        with self._lock:
            if len(self._events) >= self._max:
                self._events.popleft()
                self.dropped += 1
            self._events.append(converted)

    def take(self) -> KVShelfKVEvents | None:
        """The events since the last call (None when there are none)."""
        with self._lock:
            if not self._events:
                return None
            events, self._events = list(self._events), deque()
        return KVShelfKVEvents(events)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
