"""SnapKV: the observation window at the end of the prompt votes for the tokens to keep.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024). The last
``window`` prompt tokens (usually the question) attend to the rest; their attention, averaged over the window
and smoothed by a 1-D pooling (so neighbours of an important token come along), picks the tokens per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod
from kvshelf.kvstore.errors import ConfigError


@dataclass
class SnapKV(PruningMethod):
    """Observation-window voting with pooling, per KV head (GQA: mean over the query heads of a group).

    Does not need attention weights: the window's queries ``[b, h_q, w, d]`` are recomputed from the layer input
    along the model's own query path (``hf.attention_queries``), and scaled and soft-capped as the model does.
    The window itself is always kept. Max pooling keeps whole neighbourhoods of a voted token (e.g. every digit
    of a number), where average pooling dilutes its edges. ``score``: ``[b, h_kv, n]``.
    """

    recomputes_queries: ClassVar[bool] = True
    window: int = 16  # the last tokens (the question): tuned on needle cases disjoint from the benchmark's (see
    # docs/pruning.md); a 64-token window (kvpress's) mixes context tokens into the vote and loses needles at 25%
    kernel: int = 7
    pooling: str = "max"  # the paper's clustering; "avg" (kernel 5) is kvpress's choice

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in ("max", "avg") or self.kernel < 1 or self.kernel % 2 == 0 or self.window < 1:
            raise ConfigError(f"SnapKV needs pooling 'max' or 'avg', an odd kernel >= 1 and a window >= 1; "
                              f"got pooling={self.pooling!r}, kernel={self.kernel}, window={self.window}")

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        n = layer.tokens
        w = min(self.window, n - 1)
        if w <= 0:
            return torch.zeros(layer.keys.shape[:3], device=layer.keys.device)
        logits = layer.logits(layer.queries(w))  # [b, h_q, w, n], as the model scales and caps them
        causal = torch.ones(w, w, dtype=torch.bool, device=logits.device).triu(1)
        logits[..., -w:] = logits[..., -w:].masked_fill(causal, float("-inf"))
        votes = torch.softmax(logits, dim=-1)[..., :-w].mean(dim=2)  # [b, h_q, n - w]
        pad = self.kernel // 2
        if self.pooling == "max":
            votes = F.max_pool1d(votes, self.kernel, stride=1, padding=pad)
        else:
            votes = F.avg_pool1d(votes, self.kernel, stride=1, padding=pad, count_include_pad=False)
        scores = layer.to_kv_heads(votes)  # [b, h_kv, n - w]
        return F.pad(scores, (0, w), value=float("inf"))
