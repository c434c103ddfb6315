"""Selective recompute of reused chunk KV (CacheBlend, Yao et al., EuroSys 2025).

Independently computed chunks miss their cross-chunk attention. CacheBlend recomputes every token at an early
layer, picks the tokens whose KV deviates most from the reused KV there ("high-KV-deviation" tokens), and
recomputes only those through the remaining layers, blending their fresh KV into the reused cache. The choice is
model-independent and lives here; the layer-by-layer forward is in ``adapters.reuse_engine``.
"""

from __future__ import annotations

import math

import torch

from kvshelf.kvstore.errors import ConfigError

DEFAULT_RATIO = 0.15


def check_ratio(ratio: float) -> float:
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"recompute ratio must be in [0, 1], got {ratio}")
    return float(ratio)


def kv_deviation(
    old_keys: torch.Tensor, old_values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor
) -> torch.Tensor:
    """Per-token deviation ``||dK||^2 / ||K||^2 + ||dV||^2 / ||V||^2`` summed over heads.

    All inputs ``[batch=1, kv_heads, tokens, head_dim]``; returns ``[tokens]`` (float32).
    """
    dk = (new_keys.float() - old_keys.float()).pow(2).sum(dim=(0, 1, 3))
    dv = (new_values.float() - old_values.float()).pow(2).sum(dim=(0, 1, 3))
    nk = new_keys.float().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)
    nv = new_values.float().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)
    return dk / nk + dv / nv


def select_recompute(deviation: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (sorted ascending) of the ``ceil(ratio * tokens)`` tokens with the largest deviation.

    ``deviation``: ``[tokens]``; returns ``[k]`` long.
    """
    ratio = check_ratio(ratio)
    count = min(deviation.shape[0], math.ceil(ratio * deviation.shape[0]))
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    top = torch.topk(deviation, count).indices
    return torch.sort(top).values
