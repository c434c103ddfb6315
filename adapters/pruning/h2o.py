"""H2O: heavy hitters by accumulated attention, plus recent tokens.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(NeurIPS 2023). A token's importance is the attention it received, summed over all queries; the cache keeps the
heaviest hitters and a window of recent tokens (half and half in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, recent_bonus


@dataclass
class H2O(PruningMethod):
    """Accumulated attention per KV head (summed over the GQA group), ``recent_ratio`` of the budget recent.

    Reads ``LayerInputs.attention_mass``: the prefill's causal attention weights summed over queries, computed in row
    chunks from recomputed queries (any attention implementation), or from eager weights on a model whose queries
    cannot be recomputed. ``score``: ``[b, h_kv, n]`` = sum over queries and group heads; recent +inf.
    """

    recent_ratio: float = 0.5
    attention_mass: ClassVar[bool] = True

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        """``[b, h_kv, n]`` attention mass received by each token."""
        return layer.to_kv_heads(layer.attention_mass(), reduce="sum")

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, int(keep * self.recent_ratio))
