"""The CPU tier in page-locked ("pinned") memory, for a GPU to read blocks by DMA.

A copy to the GPU from ordinary (pageable) memory goes through a staging buffer at a fraction of the bus's speed;
from page-locked memory it runs at the bus's speed and needs no extra copy. ``PinnedMemoryTier`` is the
``MemoryTier`` (same capacity, policies, accounting and contract) with each value copied, when stored, into a
buffer of its own that is registered with CUDA (``cudaHostRegister``, unregistered when the buffer is freed;
registering an existing allocation avoids the power-of-two rounding of torch's pinned allocator). Its reads
return ``memoryview`` objects over those buffers (bytes-like; ``kvstore.encoding`` reads them without a copy), so
a ``raw`` block decodes as tensor views of pinned memory and lands in the cache with one DMA.

The code is the same everywhere: where CUDA is absent (CI), values live in ordinary buffers and the tier behaves
(and is tested) as on a GPU machine, without the registration.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch

from kvshelf.kvstore.memory_tier import MemoryTier

log = logging.getLogger(__name__)

#: values shorter than this are not registered (registration costs more than the copy it speeds up)
MIN_PINNED_BYTES = 64 << 10


def _register(array: np.ndarray) -> bool:
    """Page-lock ``array``'s memory for CUDA until the array is freed; False where that failed."""
    cudart = torch.cuda.cudart()
    pointer = array.ctypes.data
    status = cudart.cudaHostRegister(pointer, array.nbytes, 0)
    if int(status) != 0:
        return False
    weakref.finalize(array, cudart.cudaHostUnregister, pointer)
    return True


class PinnedMemoryTier(MemoryTier):
    """A ``MemoryTier`` whose values sit in page-locked buffers (``pin``: default, where CUDA is available);
    ``get_many`` returns ``memoryview`` objects over them. Same arguments as ``MemoryTier``."""

    def __init__(self, capacity_bytes: int, name: str = "memory", *, pin: bool | None = None, **options: Any) -> None:
        super().__init__(capacity_bytes, name, **options)
        self.page_lock = torch.cuda.is_available() if pin is None else pin
        self._pin_failures = 0

    holds_checked_copies = False  # its memoryviews are writable (a read's caller could change the tier's bytes)

    def _own_copy(self, value: bytes | bytearray | memoryview) -> memoryview:  # type: ignore[override]
        """A page-locked copy of ``value`` (a ``memoryview`` over it)."""
        array = np.empty(len(value), dtype=np.uint8)
        view = memoryview(array)
        if len(value):
            view[:] = memoryview(value).cast("B")
        if self.page_lock and len(value) >= MIN_PINNED_BYTES and not _register(array):
            self._pin_failures += 1
            if self._pin_failures == 1:
                log.warning("tier %s: could not page-lock a %d-byte value (cudaHostRegister failed): values that "
                            "cannot be pinned are kept in ordinary memory", self.name, len(value))
        return view

    @property
    def pin_failures(self) -> int:
        """How many values could not be page-locked (held in ordinary memory)."""
        return self._pin_failures
