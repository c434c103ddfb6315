"""Context reuse beyond prefixes: prompt modules, RAG chunks, block attention, RoPE re-encoding, selective
recompute. Model-independent; the HF front doors are ``adapters.rag`` and ``adapters.prompt_modules``."""

from kvshelf.reuse.blend import DEFAULT_RATIO, kv_deviation, select_recompute
from kvshelf.reuse.chunking import chunk_tokens
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
from kvshelf.reuse.rope import rerotate_keys
from kvshelf.reuse.schema import Module, ModuleUse, Param, PromptSchema, assemble, parse_prompt

__all__ = [
    "DEFAULT_RATIO",
    "ChunkMissingError",
    "ContextTooLongError",
    "ForeignChunkError",
    "MissingParameterError",
    "Module",
    "ModuleUse",
    "Param",
    "ParameterTooLongError",
    "PromptLayoutError",
    "PromptSchema",
    "ReuseError",
    "SchemaError",
    "UnknownModuleError",
    "UnknownParameterError",
    "assemble",
    "chunk_tokens",
    "kv_deviation",
    "parse_prompt",
    "rerotate_keys",
    "select_recompute",
]
