"""Long contexts beyond memory: tier-backed sparse attention (``TierSparse``; see ``session`` for the design)."""

from kvshelf.adapters.longctx.errors import (
    BlockLostError,
    LongContextError,
    ResidentBudgetError,
)
from kvshelf.adapters.longctx.method import TierSparse
from kvshelf.adapters.longctx.session import SparseSession, SparseStats

__all__ = ["BlockLostError", "LongContextError", "ResidentBudgetError", "SparseSession",
           "SparseStats", "TierSparse"]
