"""Token pruning (static: StreamingLLM, H2O, Keyformer, SnapKV, key norm) and selection (dynamic: TokenSelect).

Use any method as a context manager around ``model.generate`` (transformers 5.x)::

    from adapters.pruning import SnapKV, TokenSelect
    with SnapKV(budget=0.25)(model):          # the prompt's cache is pruned to 25% after the prefill
        out = model.generate(input_ids, max_new_tokens=16)
    with TokenSelect(budget=0.125)(model):    # full cache, each decode step attends to 12.5% of it
        out = model.generate(input_ids, max_new_tokens=16)

A budget is a ratio of the prefill's tokens in ``(0, 1]`` or an int token count.
"""

from adapters.pruning.base import LayerInputs, PruningMethod, PruningSession, prune_cache, scoring, select
from adapters.pruning.budget import resolve_budget
from adapters.pruning.compose import Compose
from adapters.pruning.errors import (
    AttentionImplementationError,
    BudgetError,
    PruningError,
    UnsupportedArchitectureError,
)
from adapters.pruning.h2o import H2O
from adapters.pruning.keyformer import Keyformer
from adapters.pruning.keynorm import KeyNorm
from adapters.pruning.snapkv import SnapKV
from adapters.pruning.streaming import StreamingLLM
from adapters.pruning.tokenselect import TokenSelect

METHODS: dict[str, type] = {
    "streamingllm": StreamingLLM,
    "h2o": H2O,
    "keyformer": Keyformer,
    "snapkv": SnapKV,
    "keynorm": KeyNorm,
    "tokenselect": TokenSelect,
}

__all__ = [
    "METHODS", "H2O", "AttentionImplementationError", "BudgetError", "Compose", "KeyNorm", "Keyformer",
    "LayerInputs", "PruningError", "PruningMethod", "PruningSession", "SnapKV", "StreamingLLM", "TokenSelect",
    "UnsupportedArchitectureError", "prune_cache", "resolve_budget", "scoring", "select",
]
