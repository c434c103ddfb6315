"""Keyformer: key tokens by Gumbel-softmax scoring of the attention logits.

Adnan et al., "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative Inference"
(MLSys 2024). Plain accumulated softmax (H2O) over-weights some tokens once others are dropped; Keyformer adds
Gumbel noise to the logits and a temperature ``tau`` before the softmax, then accumulates, plus a recent window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, recent_bonus


@dataclass
class Keyformer(PruningMethod):
    """Accumulated Gumbel-softmax ``softmax((logits + G) / tau)`` per KV head; ``recent_ratio`` of budget recent.

    The logits are recovered from the attention weights ``[b, h_q, n, n]`` as ``log(weights)`` (equal to the
    logits up to a per-row constant, which the softmax ignores); masked entries stay masked. ``G`` is standard
    Gumbel noise from a generator seeded with ``seed`` (reproducible). Needs ``attn_implementation="eager"``.
    ``score``: ``[b, h_kv, n]``.
    """

    tau: float = 1.0
    recent_ratio: float = 0.3
    seed: int = 0
    needs_attentions: ClassVar[bool] = True

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        assert layer.attentions is not None
        gen = torch.Generator(device="cpu").manual_seed(self.seed + int(layer.module.layer_idx))
        # Gumbel noise G = -log(E), E ~ Exp(1); log(weights) is -inf where masked, and stays masked
        gumbel = -torch.empty(layer.attentions.shape).exponential_(generator=gen).log_().to(layer.attentions.device)
        masked = layer.attentions == 0
        logits = layer.attentions.float().clamp_min(1e-30).log_().masked_fill_(masked, float("-inf"))
        probs = torch.softmax(logits.add_(gumbel).div_(self.tau), dim=-1)
        return layer.to_kv_heads(probs.sum(dim=2), reduce="sum")

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, int(keep * self.recent_ratio))
