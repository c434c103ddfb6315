"""Composition of static methods: a rank ensemble under one budget.

Each method's scores are turned into ranks per head (0 = worst, 1 = best, +inf-forced tokens stay forced) and
the weighted ranks are summed, so e.g. ``Compose([StreamingLLM(), SnapKV()])`` keeps the sinks and recent window
and fills the rest with SnapKV's choice. Static and dynamic methods compose by nesting context managers:
``with SnapKV(0.5)(model), TokenSelect(0.125)(model): model.generate(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod
from kvshelf.kvstore.errors import ConfigError


@dataclass
class Compose(PruningMethod):
    """``score``: ``[b, h_kv, n]`` = sum of ``weights[i] * rank(methods[i].score)``; forced tokens +inf."""

    methods: list[PruningMethod] = field(default_factory=list)
    weights: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.methods:
            raise ConfigError("Compose needs at least one method")
        if self.weights is not None and len(self.weights) != len(self.methods):
            raise ConfigError(f"Compose got {len(self.weights)} weights for {len(self.methods)} methods")

    @property
    def needs_attentions(self) -> bool:  # type: ignore[override]
        return any(m.needs_attentions for m in self.methods)

    @property
    def recomputes_queries(self) -> bool:  # type: ignore[override]
        return any(m.recomputes_queries for m in self.methods)

    @property
    def attention_mass(self) -> bool:  # type: ignore[override]
        return any(m.attention_mass for m in self.methods)

    @property
    def name(self) -> str:
        return "+".join(m.name for m in self.methods)

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        return torch.empty(0)  # ranks depend on the budget: ``select_from`` scores from scratch

    def select_from(self, layer: LayerInputs, base: torch.Tensor) -> torch.Tensor:
        return self.keep_indices(layer)

    def score(self, layer: LayerInputs, keep: int) -> torch.Tensor:
        weights = self.weights or [1.0] * len(self.methods)
        total = torch.zeros(layer.keys.shape[:3], device=layer.keys.device)
        for method, weight in zip(self.methods, weights, strict=True):
            scores = method.score(layer, keep).float()
            ranks = scores.argsort(dim=-1).argsort(dim=-1).float() / max(layer.tokens - 1, 1)
            total += weight * ranks.masked_fill(torch.isinf(scores) & (scores > 0), float("inf"))
        return total
