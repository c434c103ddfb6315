"""Token chunking of documents for RAG chunk caches (TurboRAG, Lu et al. 2024)."""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.kvstore.errors import ConfigError


def chunk_tokens(ids: Sequence[int], chunk_size: int, overlap: int = 0) -> list[list[int]]:
    """Split ``ids`` into chunks of ``chunk_size`` tokens; consecutive chunks share ``overlap`` tokens.

    The last chunk may be shorter; a document shorter than ``chunk_size`` is one chunk; no chunk is made only
    of tokens the previous chunk already covers.
    """
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be > 0, got {chunk_size}")
    if not 0 <= overlap < chunk_size:
        raise ConfigError(f"overlap must be in [0, chunk_size={chunk_size}), got {overlap}")
    ids = [int(t) for t in ids]
    if not ids:
        return []
    step = chunk_size - overlap
    chunks = []
    for start in range(0, len(ids), step):
        chunks.append(ids[start : start + chunk_size])
        if start + chunk_size >= len(ids):
            break
    return chunks
