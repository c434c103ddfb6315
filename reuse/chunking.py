"""Token chunking of documents for RAG chunk caches (TurboRAG, Lu et al. 2024).

One function splits text into chunks everywhere: ``rag.precompute`` splits each document with it, and
``RAGGenerator`` splits a chunk longer than its ``chunk_size`` with it too, so a text given at query time as it
was given to ``precompute`` gives the same chunks, and so the same store keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.kvstore.errors import ConfigError


def check_chunking(chunk_size: int, overlap: int = 0) -> None:
    """Refuse (``ConfigError``) a ``chunk_size`` <= 0 or an ``overlap`` outside ``[0, chunk_size)``."""
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be > 0, got {chunk_size}")
    if not 0 <= overlap < chunk_size:
        raise ConfigError(f"overlap must be in [0, chunk_size={chunk_size}), got {overlap}")


def chunk_spans(length: int, chunk_size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """The ``(start, end)`` token spans of the chunks of a ``length``-token text (see ``chunk_tokens``)."""
    check_chunking(chunk_size, overlap)
    step = chunk_size - overlap
    spans = []
    for start in range(0, length, step):
        spans.append((start, min(length, start + chunk_size)))
        if start + chunk_size >= length:
            break
    return spans


def chunk_tokens(ids: Sequence[int], chunk_size: int, overlap: int = 0) -> list[list[int]]:
    """Split ``ids`` into chunks of ``chunk_size`` tokens; consecutive chunks share ``overlap`` tokens.

    The last chunk may be shorter; a document shorter than ``chunk_size`` is one chunk; no chunk is made only
    of tokens the previous chunk already covers.
    """
    ids = [int(t) for t in ids]
    return [ids[start:end] for start, end in chunk_spans(len(ids), chunk_size, overlap)]
