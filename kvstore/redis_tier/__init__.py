"""Redis tier: the shared tier of several kvshelf processes or machines, on standalone Redis or Redis Cluster.

Each value lives under one hash tag (one Cluster slot): chunks written first, the manifest last, a fresh generation
per write; damaged or partly evicted values read as misses and are removed; Redis evicts by itself
(``maxmemory-policy allkeys-lfu``) and the usage registry counts what it evicted; a circuit breaker keeps a dead
Redis from costing every call a timeout. The design, its costs and the Redis settings: docs/storage.md
("Redis tier").

Modules: ``tier`` (``RedisTier``), ``connection`` (URLs, client, breaker, pipelines), ``layout`` (key names,
manifest header, limits), ``reads`` (get/contains, damage), ``writes`` (put), ``delete`` (delete, Clear, key
listings), ``accounting`` (usage registry, reconciliation).
"""

from kvshelf.kvstore.redis_tier.connection import BACKOFF_FIRST_S, BACKOFF_MAX_S, Client, connector
from kvshelf.kvstore.redis_tier.layout import (
    CLEAR_BATCH,
    CLEAR_SCAN_COUNT,
    DEFAULT_MAX_VALUE_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    read_manifest,
)
from kvshelf.kvstore.redis_tier.tier import RedisTier

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "CLEAR_BATCH",
    "CLEAR_SCAN_COUNT",
    "DEFAULT_MAX_VALUE_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "Client",
    "RedisTier",
    "connector",
    "read_manifest",
]
