"""kvshelf: KV-cache management and context-reuse middleware for transformer LLMs.

The public API, importable from here::

    import kvshelf

    model, tokenizer = kvshelf.load_model("smollm2-135m")
    store = kvshelf.open_embedded_store("/tmp/kvshelf-data")
    gen = kvshelf.CachedGenerator(model, tokenizer, store)

The parts are subpackages: ``kvshelf.kvstore`` (blocks, keys, tiers, the store), ``kvshelf.compress`` (codecs),
``kvshelf.reuse`` (prompt modules, RAG chunks, RoPE), ``kvshelf.adapters`` (HuggingFace transformers),
``kvshelf.service`` (gRPC service and client), ``kvshelf.proto``, ``kvshelf.bench`` and ``kvshelf.cli`` (the
``kvshelf`` command). Their folders sit at the
top of the repository; ``pyproject.toml`` maps them under this package (see docs/architecture.md, "Packaging").

Names are loaded on first use, so ``import kvshelf`` (and the ``kvshelf`` command) starts without torch,
transformers or grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # models and generation
    "load_model": "kvshelf.adapters.model",
    "tiny_llama": "kvshelf.adapters.model",
    "model_fingerprint": "kvshelf.adapters.fingerprint",
    "CachedGenerator": "kvshelf.adapters.generate",
    "GenerationResult": "kvshelf.adapters.generate",
    "MissReason": "kvshelf.adapters.miss",
    "MissKind": "kvshelf.adapters.miss",
    "MissReport": "kvshelf.adapters.miss",
    "RAGGenerator": "kvshelf.adapters.rag",
    "RAGResult": "kvshelf.adapters.rag",
    "precompute": "kvshelf.adapters.rag",
    "PrecomputeResult": "kvshelf.adapters.rag",
    "ChunkHandle": "kvshelf.adapters.rag",
    "Conversation": "kvshelf.adapters.chat",
    "ChatTurn": "kvshelf.adapters.chat",
    "TokenStream": "kvshelf.adapters.streaming",
    "cached_prefix": "kvshelf.adapters.export",
    "CachedPrefix": "kvshelf.adapters.export",
    "PromptModuleGenerator": "kvshelf.adapters.prompt_modules",
    "ModuleResult": "kvshelf.adapters.prompt_modules",
    "PromptSchema": "kvshelf.reuse.schema",
    # stores
    "BlockStore": "kvshelf.kvstore.protocol",
    "open_embedded_store": "kvshelf.kvstore.embedded",
    "TieredStore": "kvshelf.kvstore.store",
    "TierSpec": "kvshelf.kvstore.store",
    "KVBlock": "kvshelf.kvstore.block",
    "prefix_block_keys": "kvshelf.kvstore.keys",
    "RemoteStore": "kvshelf.service.client",
    "WriteBehind": "kvshelf.kvstore.write_behind",
    "EvictionPolicy": "kvshelf.kvstore.eviction",
    "make_policy": "kvshelf.kvstore.eviction",
    # codecs
    "available_codecs": "kvshelf.kvstore.codec",
    "get_codec": "kvshelf.kvstore.codec",
    # token pruning and selection
    "StreamingLLM": "kvshelf.adapters.pruning",
    "H2O": "kvshelf.adapters.pruning",
    "Keyformer": "kvshelf.adapters.pruning",
    "SnapKV": "kvshelf.adapters.pruning",
    "KeyNorm": "kvshelf.adapters.pruning",
    "TokenSelect": "kvshelf.adapters.pruning",
    "FastKV": "kvshelf.adapters.pruning",
    "Compose": "kvshelf.adapters.pruning",
    "PRUNING_METHODS": "kvshelf.adapters.pruning",
    # long contexts beyond memory
    "TierSparse": "kvshelf.adapters.longctx.method",
    "LongContextError": "kvshelf.adapters.longctx.errors",
    "ResidentBudgetError": "kvshelf.adapters.longctx.errors",
    "BlockLostError": "kvshelf.adapters.longctx.errors",
    # errors: one tree under KVShelfError
    "KVShelfError": "kvshelf.kvstore.errors",
    "ConfigError": "kvshelf.kvstore.errors",
    "UnknownCodecError": "kvshelf.kvstore.errors",
    "CodecParamError": "kvshelf.kvstore.errors",
    "CorruptBlockError": "kvshelf.kvstore.errors",
    "ForeignBlockError": "kvshelf.kvstore.errors",
    "StoreFullError": "kvshelf.kvstore.errors",
    "TierUnavailableError": "kvshelf.kvstore.errors",
    "TierDamagedError": "kvshelf.kvstore.errors",
    "BlockTooLargeError": "kvshelf.kvstore.errors",
    "WriteBehindError": "kvshelf.kvstore.errors",
    "UnsupportedModelError": "kvshelf.kvstore.errors",
    "ModelLoadError": "kvshelf.kvstore.errors",
    "ReuseError": "kvshelf.reuse.errors",
    "SchemaError": "kvshelf.reuse.errors",
    "UnknownModuleError": "kvshelf.reuse.errors",
    "UnknownParameterError": "kvshelf.reuse.errors",
    "MissingParameterError": "kvshelf.reuse.errors",
    "ParameterTooLongError": "kvshelf.reuse.errors",
    "PromptLayoutError": "kvshelf.reuse.errors",
    "ContextTooLongError": "kvshelf.reuse.errors",
    "ChunkMissingError": "kvshelf.reuse.errors",
    "ForeignChunkError": "kvshelf.reuse.errors",
    "XQuantUnboundError": "kvshelf.compress.xquant",
    "PruningError": "kvshelf.adapters.pruning.errors",
    "BudgetError": "kvshelf.adapters.pruning.errors",
    "AttentionImplementationError": "kvshelf.adapters.pruning.errors",
    "UnsupportedArchitectureError": "kvshelf.adapters.pruning.errors",
    "ServiceError": "kvshelf.service.errors",
    "RemoteStoreError": "kvshelf.service.errors",
    "WireError": "kvshelf.service.errors",
    "WireLimitError": "kvshelf.service.errors",
    "BearerError": "kvshelf.service.errors",
    "ArenaUnavailable": "kvshelf.service.errors",
    "StreamRefusedError": "kvshelf.service.errors",
    "DataPathError": "kvshelf.service.errors",
    "TicketError": "kvshelf.service.errors",
    "FramingError": "kvshelf.service.errors",
    "HttpRequestError": "kvshelf.service.http_server",
    "DataPathUnavailable": "kvshelf.service.errors",
    "TraceError": "kvshelf.kvstore.errors",
}
#: names whose attribute in their module differs from the public one
_RENAMED = {"PRUNING_METHODS": "METHODS"}

__all__ = [  # the literal list static tools read; a test checks it against _EXPORTS
    "__version__", "load_model", "tiny_llama", "model_fingerprint", "CachedGenerator", "GenerationResult",
    "MissReason", "MissKind", "MissReport", "RAGGenerator", "RAGResult", "precompute", "PrecomputeResult",
    "ChunkHandle", "Conversation", "ChatTurn",
    "TokenStream", "cached_prefix", "CachedPrefix", "PromptModuleGenerator", "ModuleResult", "PromptSchema",
    "BlockStore", "open_embedded_store", "TieredStore", "TierSpec", "KVBlock", "prefix_block_keys",
    "RemoteStore", "WriteBehind",
    "available_codecs", "get_codec", "StreamingLLM", "H2O", "Keyformer", "SnapKV", "KeyNorm", "TokenSelect", "Compose",
    "FastKV", "PRUNING_METHODS", "TierSparse", "LongContextError", "ResidentBudgetError", "BlockLostError",
    "KVShelfError", "ConfigError", "UnknownCodecError", "CodecParamError",
    "CorruptBlockError",
    "ForeignBlockError", "StoreFullError", "TierUnavailableError", "WriteBehindError", "UnsupportedModelError",
    "ModelLoadError", "ReuseError", "SchemaError", "UnknownModuleError", "UnknownParameterError",
    "MissingParameterError", "ParameterTooLongError", "PromptLayoutError", "ContextTooLongError", "ChunkMissingError",
    "ForeignChunkError", "XQuantUnboundError", "PruningError", "BudgetError", "AttentionImplementationError",
    "UnsupportedArchitectureError", "ServiceError", "RemoteStoreError", "WireError", "WireLimitError",
    "BearerError", "ArenaUnavailable", "DataPathError", "TicketError", "FramingError",
    "DataPathUnavailable", "HttpRequestError",
    "TierDamagedError", "BlockTooLargeError", "StreamRefusedError", "EvictionPolicy", "make_policy", "TraceError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshelf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what static type checkers and IDEs see
    from kvshelf.adapters.chat import ChatTurn, Conversation
    from kvshelf.adapters.export import CachedPrefix, cached_prefix
    from kvshelf.adapters.fingerprint import model_fingerprint
    from kvshelf.adapters.generate import CachedGenerator, GenerationResult
    from kvshelf.adapters.longctx import TierSparse
    from kvshelf.adapters.longctx.errors import BlockLostError, LongContextError, ResidentBudgetError
    from kvshelf.adapters.model import load_model, tiny_llama
    from kvshelf.adapters.prompt_modules import ModuleResult, PromptModuleGenerator
    from kvshelf.adapters.pruning import H2O, Compose, FastKV, Keyformer, KeyNorm, SnapKV, StreamingLLM, TokenSelect
    from kvshelf.adapters.pruning import METHODS as PRUNING_METHODS
    from kvshelf.adapters.pruning.errors import (
        AttentionImplementationError,
        BudgetError,
        PruningError,
        UnsupportedArchitectureError,
    )
    from kvshelf.adapters.rag import ChunkHandle, PrecomputeResult, RAGGenerator, RAGResult, precompute
    from kvshelf.adapters.streaming import TokenStream
    from kvshelf.compress.xquant import XQuantUnboundError
    from kvshelf.kvstore.block import KVBlock
    from kvshelf.kvstore.codec import available_codecs, get_codec
    from kvshelf.kvstore.embedded import open_embedded_store
    from kvshelf.kvstore.errors import (
        BlockTooLargeError,
        CodecParamError,
        ConfigError,
        CorruptBlockError,
        ForeignBlockError,
        KVShelfError,
        ModelLoadError,
        StoreFullError,
        TierDamagedError,
        TierUnavailableError,
        TraceError,
        UnknownCodecError,
        UnsupportedModelError,
        WriteBehindError,
    )
    from kvshelf.kvstore.eviction import EvictionPolicy, make_policy
    from kvshelf.kvstore.keys import prefix_block_keys
    from kvshelf.kvstore.protocol import BlockStore
    from kvshelf.kvstore.store import TieredStore, TierSpec
    from kvshelf.kvstore.write_behind import WriteBehind
    from kvshelf.reuse.errors import (
        ChunkMissingError,
        ContextTooLongError,
        ForeignChunkError,
        MissingParameterError,
        ParameterTooLongError,
        PromptLayoutError,
        ReuseError,
        SchemaError,
        UnknownModuleError,
        UnknownParameterError,
    )
    from kvshelf.reuse.schema import PromptSchema
    from kvshelf.service.client import RemoteStore
    from kvshelf.service.errors import (
        ArenaUnavailable,
        BearerError,
        DataPathError,
        DataPathUnavailable,
        FramingError,
        RemoteStoreError,
        ServiceError,
        StreamRefusedError,
        TicketError,
        WireError,
        WireLimitError,
    )
    from kvshelf.service.http_server import HttpRequestError
