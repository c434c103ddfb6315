"""Errors of token pruning and selection (all ``KVShelfError`` subclasses)."""

from __future__ import annotations

from kvshelf.kvstore.errors import ConfigError, KVShelfError, UnsupportedModelError


class PruningError(KVShelfError):
    """Base class of the pruning errors."""


class BudgetError(PruningError, ConfigError):
    """A budget <= 0, or larger than the context it applies to."""


class AttentionImplementationError(PruningError, ConfigError):
    """A method needs attention weights but the model's attention implementation does not return them."""


class UnsupportedArchitectureError(PruningError, UnsupportedModelError):
    """A model whose attention modules a method cannot hook (not a Llama-style RoPE decoder)."""
