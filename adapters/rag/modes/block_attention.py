"""``block-attention`` (Block-Attention, Sun et al. 2024): each chunk encoded after the shared prefix only (a
block-diagonal mask) and cached under a key that includes the prefix; the question attends to everything."""

from __future__ import annotations

from kvshelf.adapters.rag.chunks import BLOCK
from kvshelf.adapters.rag.modes.assembled import AssembledMode
from kvshelf.adapters.rag.modes.base import Exactness


class BlockAttentionMode(AssembledMode):
    name = "block-attention"
    # one block after the prefix: the same KV as full prefill's
    exactness = Exactness(max_chunks=1)

    def kind(self, blend_base: str) -> str:
        return BLOCK
