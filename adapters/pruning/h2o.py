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

    Needs attention weights ``[b, h_q, n, n]`` (``attn_implementation="eager"``).
    ``score``: ``[b, h_kv, n]`` = sum over queries and group heads of the attention weights; recent +inf.
    """

    recent_ratio: float = 0.5
    needs_attentions: ClassVar[bool] = True

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        """``[b, h_kv, n]`` attention mass received by each token."""
        assert layer.attentions is not None
        return layer.to_kv_heads(layer.attentions.float().sum(dim=2), reduce="sum")

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, int(keep * self.recent_ratio))
