"""Errors of tier-backed sparse attention (all ``KVShelfError``)."""

from __future__ import annotations

from kvshelf.kvstore.errors import ConfigError, KVShelfError


class LongContextError(KVShelfError):
    """A tier-backed sparse attention call failed."""


class ResidentBudgetError(LongContextError, ConfigError):
    """The resident memory setting cannot hold the sinks, the window and the per-layer working set."""


class BlockLostError(LongContextError):
    """A block the attention selected is gone from the store (evicted, damaged, or another model's): the call
    fails rather than attend to anything else."""
