"""Loading a cached prefix into a fresh cache: ``PrefixLoader`` and its plain-KV implementation.

``CachedGenerator`` looks up the longest run of stored blocks of a prompt (chained keys) and hands the found spans
to its loader. ``KVPrefixLoader`` loads the blocks (full-attention and sliding-window layers); a model with
recurrent-state layers gets ``hybrid.HybridPrefixLoader``, which loads blocks only with the state snapshot of
their last boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from kvshelf.adapters.cache_bridge import cache_from_tensors, tensors_from_prepared
from kvshelf.kvstore.block import PreparedBlock
from kvshelf.kvstore.keys import BlockSpan
from kvshelf.kvstore.protocol import BlockStore


@dataclass
class Row:
    """One prompt of a call: its ids, what was loaded for it, and its cache once prefilled. ``asked`` and
    ``found``: the blocks its lookup asked for and found (``looked``: a lookup ran). ``loaded_kv``: the keys,
    blocks and the ``[layers, kv_heads, tokens, head_dim]`` key and value tensors a plain load built (the store's
    device tier may take them), until the generator consumes them."""

    ids: list[int]
    reused: int = 0
    loaded: int = 0
    missed: bool = False
    cache: Any = None
    looked: bool = False
    asked: int = 0
    found: int = 0
    loaded_kv: tuple[list[bytes], list[PreparedBlock], torch.Tensor, torch.Tensor] | None = None


class PrefixLoader(Protocol):
    """Loads the cached prefix of ``row`` whose first ``found`` spans (of ``spans``, ``tokens`` tokens each) the
    store holds: sets ``row.cache`` (a fresh cache of ``row.reused <= len(row.ids) - 1`` tokens), ``row.reused``
    and ``row.loaded``; loads nothing when no usable prefix is found."""

    def load(self, row: Row, spans: list[BlockSpan], tokens: list[int], found: int, fingerprint: str) -> Row: ...


@dataclass(frozen=True)
class KVPrefixLoader:
    """Plain KV: the found blocks up to the first damaged or vanished one, as one cache."""

    model: PreTrainedModel
    store: BlockStore
    namespace: str

    def load(self, row: Row, spans: list[BlockSpan], tokens: list[int], found: int, fingerprint: str) -> Row:
        keys = [span.key for span in spans[:found]]
        blocks = self.store.get_prepared_many(keys, fingerprint=fingerprint, namespace=self.namespace,
                                              tokens=tokens[:found])
        usable = []
        for block in blocks:  # a damaged or vanished block ends the usable prefix
            if block is None:
                break
            usable.append(block)
        if not usable:
            return row
        row.loaded = sum(b.num_tokens for b in usable)
        row.reused = min(row.loaded, len(row.ids) - 1)
        keys_t, values_t = tensors_from_prepared(usable, device=self.model.device, dtype=self.model.dtype)
        row.cache = cache_from_tensors(keys_t, values_t, self.model.config, max_tokens=row.reused)
        row.loaded_kv = (keys[: len(usable)], usable, keys_t, values_t)
        return row
