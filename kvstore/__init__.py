"""Blocks, keys, tiers, the tiered store, eviction and stats. Knows neither transformers nor gRPC.

Names are loaded on first use (as in the root package), so importing a light module of this package
(``kvshelf.kvstore.errors``, ``kvshelf.kvstore.keys``) loads neither torch nor the tiers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "KVBlock": "kvshelf.kvstore.block",
    "open_embedded_store": "kvshelf.kvstore.embedded",
    "parse_size": "kvshelf.kvstore.sizes",
    "decode_block": "kvshelf.kvstore.encoding",
    "encode_block": "kvshelf.kvstore.encoding",
    "read_header": "kvshelf.kvstore.encoding",
    "CodecParamError": "kvshelf.kvstore.errors",
    "ConfigError": "kvshelf.kvstore.errors",
    "CorruptBlockError": "kvshelf.kvstore.errors",
    "ForeignBlockError": "kvshelf.kvstore.errors",
    "KVShelfError": "kvshelf.kvstore.errors",
    "StoreFullError": "kvshelf.kvstore.errors",
    "TierUnavailableError": "kvshelf.kvstore.errors",
    "UnknownCodecError": "kvshelf.kvstore.errors",
    "fingerprint_from_properties": "kvshelf.kvstore.fingerprint",
    "KEY_BYTES": "kvshelf.kvstore.keys",
    "BlockSpan": "kvshelf.kvstore.keys",
    "chunk_key": "kvshelf.kvstore.keys",
    "prefix_block_keys": "kvshelf.kvstore.keys",
    "prefix_block_spans": "kvshelf.kvstore.keys",
    "LMDBTier": "kvshelf.kvstore.lmdb_tier",
    "MemoryTier": "kvshelf.kvstore.memory_tier",
    "BlockStore": "kvshelf.kvstore.protocol",
    "RedisTier": "kvshelf.kvstore.redis_tier",
    "StoreEvent": "kvshelf.kvstore.stats",
    "TieredStore": "kvshelf.kvstore.store",
    "TierSpec": "kvshelf.kvstore.store",
    "Tier": "kvshelf.kvstore.tier",
    "TierUsage": "kvshelf.kvstore.tier",
    "BlockKey": "kvshelf.kvstore.keys",
    "ScopedKey": "kvshelf.kvstore.keys",
    "ScopeTag": "kvshelf.kvstore.keys",
    "scope": "kvshelf.kvstore.keys",
    "unscope": "kvshelf.kvstore.keys",
    "scope_of": "kvshelf.kvstore.keys",
    "Metric": "kvshelf.kvstore.stats",
    "StoreStats": "kvshelf.kvstore.stats",
    "TierStats": "kvshelf.kvstore.stats",
    "WriterStats": "kvshelf.kvstore.stats",
    "open_tier": "kvshelf.kvstore.tier_registry",
}

__all__ = [  # the literal list static tools read; tests/test_public_api.py checks it against _EXPORTS
    "KEY_BYTES",
    "BlockKey",
    "BlockSpan",
    "BlockStore",
    "CodecParamError",
    "ConfigError",
    "CorruptBlockError",
    "ForeignBlockError",
    "KVBlock",
    "KVShelfError",
    "LMDBTier",
    "MemoryTier",
    "Metric",
    "RedisTier",
    "ScopeTag",
    "ScopedKey",
    "StoreEvent",
    "StoreFullError",
    "StoreStats",
    "Tier",
    "TierSpec",
    "TierStats",
    "TierUnavailableError",
    "TierUsage",
    "TieredStore",
    "UnknownCodecError",
    "WriterStats",
    "chunk_key",
    "decode_block",
    "encode_block",
    "fingerprint_from_properties",
    "open_embedded_store",
    "open_tier",
    "parse_size",
    "prefix_block_keys",
    "prefix_block_spans",
    "read_header",
    "scope",
    "scope_of",
    "unscope",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshelf.kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what static type checkers and IDEs see
    from kvshelf.kvstore.block import KVBlock
    from kvshelf.kvstore.embedded import open_embedded_store
    from kvshelf.kvstore.encoding import decode_block, encode_block, read_header
    from kvshelf.kvstore.errors import (
        CodecParamError,
        ConfigError,
        CorruptBlockError,
        ForeignBlockError,
        KVShelfError,
        StoreFullError,
        TierUnavailableError,
        UnknownCodecError,
    )
    from kvshelf.kvstore.fingerprint import fingerprint_from_properties
    from kvshelf.kvstore.keys import (
        KEY_BYTES,
        BlockKey,
        BlockSpan,
        ScopedKey,
        ScopeTag,
        chunk_key,
        prefix_block_keys,
        prefix_block_spans,
        scope,
        scope_of,
        unscope,
    )
    from kvshelf.kvstore.lmdb_tier import LMDBTier
    from kvshelf.kvstore.memory_tier import MemoryTier
    from kvshelf.kvstore.protocol import BlockStore
    from kvshelf.kvstore.redis_tier import RedisTier
    from kvshelf.kvstore.sizes import parse_size
    from kvshelf.kvstore.stats import Metric, StoreEvent, StoreStats, TierStats, WriterStats
    from kvshelf.kvstore.store import TieredStore, TierSpec
    from kvshelf.kvstore.tier import Tier, TierUsage
    from kvshelf.kvstore.tier_registry import open_tier
