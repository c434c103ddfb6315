"""Blocks, keys, tiers, the tiered store, eviction and stats. Knows neither transformers nor gRPC."""

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.embedded import open_embedded_store, parse_size
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
from kvshelf.kvstore.keys import KEY_BYTES, BlockSpan, chunk_key, prefix_block_keys, prefix_block_spans
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.redis_tier import RedisTier
from kvshelf.kvstore.stats import StoreEvent
from kvshelf.kvstore.store import TieredStore, TierSpec
from kvshelf.kvstore.tier import Tier, TierUsage

__all__ = [
    "KEY_BYTES",
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
    "RedisTier",
    "StoreEvent",
    "StoreFullError",
    "Tier",
    "TierSpec",
    "TierUnavailableError",
    "TierUsage",
    "TieredStore",
    "UnknownCodecError",
    "chunk_key",
    "decode_block",
    "encode_block",
    "fingerprint_from_properties",
    "open_embedded_store",
    "parse_size",
    "prefix_block_keys",
    "prefix_block_spans",
    "read_header",
]
