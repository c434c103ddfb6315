"""``reuse`` (TurboRAG, Lu et al. 2024): each chunk's KV computed alone at position 0, loaded in the given order
with keys re-rotated to their new positions; only the question is prefilled."""

from __future__ import annotations

from kvshelf.adapters.rag.chunks import CHUNK
from kvshelf.adapters.rag.modes.assembled import AssembledMode
from kvshelf.adapters.rag.modes.base import Exactness


class ReuseMode(AssembledMode):
    name = "reuse"
    # one chunk at position 0 without a prefix: its KV alone is full prefill's
    exactness = Exactness(max_chunks=1, prefix=False)

    def kind(self, blend_base: str) -> str:
        return CHUNK
