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

    The logits are recovered from the attention weights ``[b, h_q, n, n]`` as ``log(weights)`` (equal to the
    logits up to a per-row constant, which the softmax ignores); masked entries stay masked. ``G`` is standard
    Gumbel noise ``G = -log(-log(U))``, ``U`` uniform from a PCG64 generator seeded with ``seed`` and the layer
    (reproducible). Computed in the equivalent form ``(w / E) ** (1 / tau)`` normalised per row, ``E = -log(U)``,
    ``w`` the weights: four passes over ``[b, h_q, n, n]`` instead of ten. Needs ``attn_implementation="eager"``.
    ``score``: ``[b, h_kv, n]``.
    """

    tau: float = 1.0
    recent_ratio: float = 0.3
    seed: int = 0
    needs_attentions: ClassVar[bool] = True

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        assert layer.attentions is not None
        # softmax((log w + G) / tau) with G = -log(E), E ~ Exp(1): exp((log w + G) / tau) = (w / E) ** (1 / tau), so
        # the Gumbel-softmax is (w / E) ** (1 / tau) normalised per query row; masked entries (w = 0) stay 0
        rng = np.random.default_rng((self.seed, int(layer.module.layer_idx)))
        uniform = torch.from_numpy(rng.random(layer.attentions.numel(), dtype=np.float32))
        noisy = uniform.clamp_(min=_TINY).log_().neg_().view(layer.attentions.shape).to(layer.attentions.device)
        noisy = torch.div(layer.attentions.float(), noisy, out=noisy)
        if self.tau != 1.0:
            noisy.pow_(1.0 / self.tau)
        probs = noisy.div_(noisy.sum(dim=-1, keepdim=True).clamp_min(_TINY))
        return layer.to_kv_heads(probs.sum(dim=2), reduce="sum")

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        return recent_bonus(base, int(keep * self.recent_ratio))
