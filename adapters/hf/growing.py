"""``GrowingLayer``: kvshelf's ``DynamicLayer`` subclass for pruned caches, appending in place into preallocated
buffers (see ``adapters.pruning.layout``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

DEFAULT_HEADROOM = 16


class _Buffer:
    """A ``[b, h, capacity, d]`` tensor whose first ``n`` positions (dim 2) are filled."""

    __slots__ = ("data", "n")

    def __init__(self, tensor: torch.Tensor, headroom: int) -> None:
        b, h, n, d = tensor.shape
        self.data = tensor.new_empty(b, h, n + headroom, d)
        self.data[:, :, :n].copy_(tensor)
        self.n = n

    @classmethod
    def adopt(cls, data: torch.Tensor, n: int) -> _Buffer:
        """A buffer over ``data`` ``[b, h, capacity, d]`` (not copied) whose first ``n`` positions are filled."""
        if not 0 <= n <= data.shape[2]:
            raise ValueError(f"{n} filled positions in a buffer of {data.shape[2]}")
        buffer = cls.__new__(cls)
        buffer.data, buffer.n = data, n
        return buffer

    def append(self, tensor: torch.Tensor, headroom: int) -> None:
        q = tensor.shape[2]
        if self.n + q > self.data.shape[2]:
            old = self.data[:, :, : self.n]
            b, h, _, d = old.shape
            self.data = old.new_empty(b, h, self.n + q + max(headroom, self.n // 8), d)
            self.data[:, :, : self.n].copy_(old)
        self.data[:, :, self.n:self.n + q].copy_(tensor)
        self.n += q

    def view(self) -> torch.Tensor:
        return self.data[:, :, : self.n]


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends into preallocated buffers (see ``adapters.pruning.layout``).

    Keys and values live in buffers ``[b, h, capacity, d]`` with ``headroom`` free token slots; ``keys`` /
    ``values`` are views ``[b, h, n, d]`` of the filled part. Assigning ``layer.keys = tensor`` (pruning, ``crop``,
    beam reordering) copies the tensor into a new buffer.

    Args:
        headroom: free token slots allocated past the current length, and the least a full buffer grows by.
    """

    def __init__(self, headroom: int = DEFAULT_HEADROOM) -> None:
        self.headroom = headroom
        self._k: _Buffer | None = None
        self._v: _Buffer | None = None
        super().__init__()

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, headroom: int = DEFAULT_HEADROOM) -> GrowingLayer:
        """A layer holding ``keys`` / ``values`` ``[b, h, n, d]`` (copied)."""
        layer = cls(headroom)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.keys, layer.values = keys, values
        layer.is_initialized = True
        return layer

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, n: int, headroom: int = DEFAULT_HEADROOM) -> GrowingLayer:
        """A layer over preallocated buffers ``keys`` / ``values`` ``[b, h, capacity, d]`` whose first ``n``
        positions hold the cache (taken, not copied: later appends write into their free positions). What an
        assembled layout allocated with room for the new tokens becomes without a copy of the whole cache."""
        layer = cls(headroom)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer._k, layer._v = _Buffer.adopt(keys, n), _Buffer.adopt(values, n)
        layer.is_initialized = True
        return layer

    def _store(self, tensor: torch.Tensor | None) -> _Buffer | None:
        if tensor is None or tensor.dim() != 4:  # DynamicLayer's lazy init assigns an empty 1-D tensor
            return None
        return _Buffer(tensor, self.headroom)

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k.view()

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._k = self._store(tensor)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v.view()

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._v = self._store(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, h, q, d]`` new keys / values in place; returns the whole cache ``[b, h, n, d]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None or self._v is None:
            self._k, self._v = _Buffer(key_states, self.headroom), _Buffer(value_states, self.headroom)
        else:
            self._k.append(key_states, self.headroom)
            self._v.append(value_states, self.headroom)
        return self._k.view(), self._v.view()

    def get_seq_length(self) -> int:
        return 0 if self._k is None else self._k.n

    def reset(self) -> None:
        """Drop the buffers: an empty, uninitialized layer (``DynamicLayer.reset`` zeroes them in place in
        transformers 5.0 and drops them in 5.23; a pruned cache wants them dropped in either)."""
        self._k = self._v = None
        self.is_initialized = False
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take, headroom included (``keys.nbytes + values.nbytes`` counts only the filled part)."""
        return sum(b.data.nbytes for b in (self._k, self._v) if b is not None)
