"""Per-block key summaries for block selection: Quest's channel-wise min and max.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML 2024). For a block of
keys ``K [B, d]`` keep ``m = min_t K[t]`` and ``M = max_t K[t]`` (per channel); for a query ``q`` the block's
largest logit is at most ``sum_d max(q_d m_d, q_d M_d) = relu(q) . M - relu(-q) . m``: two matrix products over
all blocks. The summaries stay in memory (float16: ``2 / B`` of the keys' bytes at float32 ... here ``4 d`` bytes
per block and head), preallocated for ``max_blocks`` blocks so that their memory does not grow with the context.

Shapes: ``L`` managed layers, ``h`` KV heads, ``g`` query heads per KV head, ``q`` queries, ``n`` blocks, ``d``
head dim.
"""

from __future__ import annotations

import torch

KINDS = ("quest", "mean")


class BlockSummaries:
    """Min/max keys of up to ``max_blocks`` blocks for each of ``layers`` layers: ``[L, h, max_blocks, d]`` each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_blocks: int,
                 dtype: torch.dtype = torch.float16, kind: str = "quest") -> None:
        if kind not in KINDS:
            raise ValueError(f"block summary {kind!r}: one of {KINDS}")
        self.kind = kind
        # [L, h, max_blocks, 2d]: the max keys then the min keys of each block (one product scores both)
        self.bounds = torch.zeros(layers, kv_heads, max_blocks, 2 * head_dim, dtype=dtype)
        self.head_dim = head_dim
        self.max_blocks = max_blocks

    @property
    def nbytes(self) -> int:
        return self.bounds.nbytes

    def add(self, layer: int, block: int, keys: torch.Tensor) -> None:
        """Summarize block ``block`` of ``layer``: ``keys [h, B, d]``."""
        d = self.head_dim
        if self.kind == "mean":  # the block's mean key (a landmark: InfLLM's representative, ShadowKV's landmark)
            self.bounds[layer, :, block, :d] = keys.float().mean(dim=1).to(self.bounds.dtype)
            return
        self.bounds[layer, :, block, :d] = keys.amax(dim=1).to(self.bounds.dtype)
        self.bounds[layer, :, block, d:] = keys.amin(dim=1).to(self.bounds.dtype)

    def votes(self, layer: int, blocks: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Each KV head's soft vote for each of the first ``blocks`` blocks: ``query [h*g, q, d]`` (the layer's
        queries) -> ``[h, blocks]``: per query head and query, a softmax over the blocks' logit bounds (scaled as
        the model's logits), summed over the query heads of the group and the queries (TokenSelect's per-head soft
        vote, over Quest's bounds)."""
        h = self.bounds.shape[1]
        hq, q, d = query.shape
        grouped = query.float().reshape(h, (hq // h) * q, d)  # [h, g*q, d]
        if self.kind == "mean":
            bound = grouped @ self.bounds[layer, :, :blocks, :d].float().transpose(1, 2)  # [h, g*q, n]
        else:
            signed = torch.cat([grouped.clamp(min=0), grouped.clamp(max=0)], dim=-1)  # [h, g*q, 2d]
            bound = signed @ self.bounds[layer, :, :blocks].float().transpose(1, 2)  # [h, g*q, n]
        return torch.softmax(bound * scaling, dim=-1).sum(dim=1)  # [h, n]
