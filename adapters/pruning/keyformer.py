"""Keyformer: key tokens by Gumbel-softmax scoring of the attention logits.

Adnan et al., "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative Inference"
(MLSys 2024). Plain accumulated softmax (H2O) over-weights some tokens once others are dropped; Keyformer adds
Gumbel noise to the logits and a temperature ``tau`` before the softmax, then accumulates, plus a recent window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, recent_bonus

_TINY = float(np.finfo(np.float32).tiny)  # U = 0 would give E = inf and drop a visible entry


@dataclass
class Keyformer(PruningMethod):
    """Accumulated Gumbel-softmax ``softmax((logits + G) / tau)`` per KV head; ``recent_ratio`` of budget recent.

    ``G = -log(-log(U))`` is standard Gumbel noise, ``U`` uniform from a PCG64 generator seeded with ``seed`` and
    the layer (reproducible). As ``softmax`` ignores a per-row constant, ``exp((logits + G) / tau)`` is
    ``(w / E) ** (1 / tau)`` with ``w`` the attention weights and ``E = -log(U)``: each row chunk of
    ``LayerInputs.attention_mass`` (recomputed queries, or eager weights where queries cannot be recomputed) is
    divided by its noise, raised to ``1 / tau`` and normalised per row; masked entries (``w = 0``) stay at zero.
    ``score``: ``[b, h_kv, n]``.
    """

    tau: float = 1.0
    recent_ratio: float = 0.3
    seed: int = 0
    attention_mass: ClassVar[bool] = True

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        rng = np.random.default_rng((self.seed, int(layer.module.layer_idx)))

        def gumbel_softmax(weights: torch.Tensor) -> torch.Tensor:  # a row chunk [b, h_q, c, m], in order
            uniform = torch.from_numpy(rng.random(weights.numel(), dtype=np.float32))
            noisy = uniform.clamp_(min=_TINY).log_().neg_().view(weights.shape).to(weights.device)  # E
            noisy = torch.div(weights, noisy, out=noisy)
            if self.tau != 1.0:
                noisy.pow_(1.0 / self.tau)
            return noisy.div_(noisy.sum(dim=-1, keepdim=True).clamp_min(_TINY))

        return layer.to_kv_heads(layer.attention_mass(gumbel_softmax), reduce="sum")

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, int(keep * self.recent_ratio))
