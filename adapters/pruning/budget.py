"""Budgets: how many tokens a method keeps (static) or attends to (dynamic)."""

from __future__ import annotations

import math

from kvshelf.adapters.pruning.errors import BudgetError


def check_budget(budget: float | int) -> None:
    """Validate the form of a budget: a ratio in ``(0, 1]`` (a float) or a token count ``>= 1`` (an int)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise BudgetError(f"budget must be a ratio in (0, 1] or a token count >= 1, got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise BudgetError(f"a budget ratio must be in (0, 1], got {budget}")
    if isinstance(budget, int) and budget <= 0:
        raise BudgetError(f"a budget token count must be >= 1, got {budget}")


def resolve_budget(budget: float | int, tokens: int) -> int:
    """Tokens to keep out of ``tokens``: ``ceil(ratio * tokens)`` for a ratio, the count itself for an int.

    Raises ``BudgetError`` for a budget <= 0 or a count larger than the context.
    """
    check_budget(budget)
    if isinstance(budget, float):
        return max(1, min(tokens, math.ceil(budget * tokens - 1e-9)))
    if budget > tokens:
        raise BudgetError(f"budget of {budget} tokens is larger than the context ({tokens} tokens)")
    return budget
