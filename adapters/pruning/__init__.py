"""Token pruning (static: StreamingLLM, H2O, Keyformer, SnapKV, key norm; at prefill time: FastKV) and selection
(dynamic: TokenSelect).

Use any method as a context manager around ``model.generate`` (transformers 5.x)::

    from kvshelf.adapters.pruning import SnapKV, TokenSelect
    with SnapKV(budget=0.25)(model):          # the prompt's cache is pruned to 25% after the prefill
        out = model.generate(input_ids, max_new_tokens=16)
    with TokenSelect(budget=0.125)(model):    # full cache, each decode step attends to 12.5% of it
        out = model.generate(input_ids, max_new_tokens=16)

A budget is a ratio of the prefill's tokens in ``(0, 1]`` or an int token count.
"""

from kvshelf.adapters.pruning.base import LayerInputs, PruningMethod, PruningSession, prune_cache, scoring, select
from kvshelf.adapters.pruning.budget import resolve_budget
from kvshelf.adapters.pruning.compose import Compose
from kvshelf.adapters.pruning.errors import (
    AttentionImplementationError,
    BudgetError,
    PruningError,
    UnsupportedArchitectureError,
)
from kvshelf.adapters.pruning.fastkv import FastKV, FastKVSession
from kvshelf.adapters.pruning.h2o import H2O
from kvshelf.adapters.pruning.keyformer import Keyformer
from kvshelf.adapters.pruning.keynorm import KeyNorm
from kvshelf.adapters.pruning.snapkv import SnapKV
from kvshelf.adapters.pruning.streaming import StreamingLLM
from kvshelf.adapters.pruning.tokenselect import TokenSelect

METHODS: dict[str, type] = {
    "streamingllm": StreamingLLM,
    "h2o": H2O,
    "keyformer": Keyformer,
    "snapkv": SnapKV,
    "keynorm": KeyNorm,
    "tokenselect": TokenSelect,
}

__all__ = [
    "METHODS", "H2O", "AttentionImplementationError", "BudgetError", "Compose", "FastKV", "FastKVSession", "KeyNorm",
    "Keyformer",
    "LayerInputs", "PruningError", "PruningMethod", "PruningSession", "SnapKV", "StreamingLLM", "TokenSelect",
    "UnsupportedArchitectureError", "prune_cache", "resolve_budget", "scoring", "select",
]
