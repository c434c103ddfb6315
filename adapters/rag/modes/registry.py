"""The RAG modes by public name (``RAGGenerator.generate(..., mode=NAME)``, ``precompute(modes=...)``). A new mode:
its module, and one line in ``MODE_CLASSES``."""

from __future__ import annotations

from collections.abc import Iterable

from kvshelf.adapters.rag.chunks import PREFIX_KIND
from kvshelf.adapters.rag.modes.base import RAGMode
from kvshelf.adapters.rag.modes.blend import BlendMode
from kvshelf.adapters.rag.modes.block_attention import BlockAttentionMode
from kvshelf.adapters.rag.modes.full import FullMode
from kvshelf.adapters.rag.modes.reuse import ReuseMode
from kvshelf.kvstore.errors import ConfigError

MODE_CLASSES: tuple[type[RAGMode], ...] = (
    FullMode,
    ReuseMode,
    BlendMode,
    BlockAttentionMode,
)
REGISTRY: dict[str, RAGMode] = {cls.name: cls() for cls in MODE_CLASSES}
MODES = tuple(REGISTRY)
PRECOMPUTE_MODES = tuple(name for name, mode in REGISTRY.items() if mode.engine)  # ``full`` reuses nothing


def get_mode(name: str) -> RAGMode:
    """The mode named ``name``; ``ConfigError`` for an unknown one."""
    mode = REGISTRY.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ConfigError(f"unknown mode {name!r}; use one of {MODES}")
    return mode


def needed_kinds(modes: Iterable[str], blend_base: str = "block") -> set[str]:
    """The kinds of stored KV the ``modes`` read: ``"chunk"`` (alone at position 0), ``"block"`` (after the
    prefix), and ``"prefix"`` (the prefix's own KV, read by every mode but ``full`` when there is a prefix)."""
    kinds: set[str] = set()
    for name in modes:
        kinds |= get_mode(name).kinds(blend_base)
    return kinds | ({PREFIX_KIND} if kinds else set())
