"""Key norm: keep the tokens whose keys have the lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024). Keys with a
low norm tend to receive high attention, so the norm alone (no attention weights, no queries) ranks tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, recent_bonus


@dataclass
class KeyNorm(PruningMethod):
    """``score``: ``[b, h_kv, n]`` = ``-||k||_2``; the last ``recent`` tokens are always kept (0 = pure key norm)."""

    recent: int = 0

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, min(self.recent, keep))
