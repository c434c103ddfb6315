"""RAG reuse for HF models through a kvshelf store: ``precompute`` (offline) and ``RAGGenerator`` (query time),
the RAG modes (``modes``), chunks and their KV (``chunks``, ``kv``). See ``generator`` for the modes and contracts.
The public names (``kvshelf.RAGGenerator``, ``kvshelf.precompute``...) are read from here."""

from kvshelf.adapters.rag.chunks import DEFAULT_CHUNK_SIZE, ChunkHandle, prefix_ids
from kvshelf.adapters.rag.generator import RAGGenerator, RAGResult
from kvshelf.adapters.rag.modes.registry import MODES
from kvshelf.adapters.rag.offline import PrecomputeResult, precompute

__all__ = ["DEFAULT_CHUNK_SIZE", "MODES", "ChunkHandle", "PrecomputeResult", "RAGGenerator", "RAGResult",
           "precompute", "prefix_ids"]
