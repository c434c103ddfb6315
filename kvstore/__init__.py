"""Blocks, keys, tiers, the tiered store, eviction and stats. Knows neither transformers nor gRPC."""

from kvstore.block import KVBlock
from kvstore.embedded import open_embedded_store, parse_size
from kvstore.encoding import decode_block, encode_block, read_header
from kvstore.errors import (
    CodecParamError,
    ConfigError,
    CorruptBlockError,
    ForeignBlockError,
    KVShelfError,
    StoreFullError,
    TierUnavailableError,
    UnknownCodecError,
)
from kvstore.fingerprint import fingerprint_from_properties
from kvstore.keys import KEY_BYTES, chunk_key, prefix_block_keys
from kvstore.lmdb_tier import LMDBTier
from kvstore.memory_tier import MemoryTier
from kvstore.redis_tier import RedisTier
from kvstore.stats import StoreEvent
from kvstore.store import TieredStore, TierSpec
from kvstore.tier import Tier, TierUsage

__all__ = [
    "KEY_BYTES",
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
    "read_header",
]
