"""StreamingLLM: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024). The first ``sinks`` tokens
draw attention whatever their content; keeping them plus the most recent tokens keeps the model stable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, recent_bonus


@dataclass
class StreamingLLM(PruningMethod):
    """Keep ``sinks`` first tokens and the ``budget - sinks`` most recent ones (same tokens in every head).

    ``score``: ``[b, h_kv, n]`` = the token's position, sinks +inf.
    """

    sinks: int = 4

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        b, h, n, _ = layer.keys.shape
        return torch.arange(n, device=layer.keys.device, dtype=torch.float32).expand(b, h, n)

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, 0, sinks=min(self.sinks, keep))
