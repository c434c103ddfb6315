"""``OwnedLayer``: a cache layer whose memory another object manages (tier-backed sparse attention).

transformers calls a cache layer's ``update(keys, values)`` inside each attention module, with the new tokens'
keys and values (RoPE applied), and passes what it returns to the attention function. An ``OwnedLayer`` hands
that call to its owner, which keeps only a bounded part of the layer in memory (sinks and a recent window) and
moves the rest to a store: the attention function then sees that in-memory part, ``[b, h_kv, m, d]``, and the
owner supplies the rest. ``get_seq_length`` reports every token the layer has seen (absolute positions), not the
in-memory part.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicLayer


class LayerOwner(Protocol):
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take ``keys``/``values`` ``[b, h_kv, q, d]`` of new tokens; return the in-memory ``[b, h_kv, m, d]``."""
        ...

    def seen(self, layer: int) -> int:
        """Tokens the layer has seen."""
        ...


class OwnedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``update`` and length are its owner's (``LayerOwner``), for cache layer ``index``."""

    def __init__(self, owner: LayerOwner, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        return self.owner.update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.seen(self.index)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a tier-backed layer cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a tier-backed layer holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a tier-backed layer holds one sequence")
