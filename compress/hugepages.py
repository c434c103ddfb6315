"""Large CPU buffers on transparent huge pages, recycled: decoding a cache into fresh memory is costly.

A 4,096-token SmolLM2 cache is ~190 MB of float32 written on every load. Fresh memory costs a page fault per
page written (~46,000 with 4 KiB pages), and on a virtual machine the host may first have to back the guest's
page as well: measured here, 2 MiB faults of fresh memory took from 0.05 to over 2 ms each, which made one load
anywhere between 40 and 300 ms. So:

* anonymous memory advised ``MADV_HUGEPAGE`` faults 2 MiB at a time where the kernel offers transparent huge
  pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``);
* a buffer is given back to a small pool when the last tensor using it is freed (a ``weakref.finalize`` on the
  numpy array the tensor is made from), and the next ``empty`` of the same size takes it, already faulted in:
  a decoded cache lives until its first forward step replaces it, so a process serving a stream of requests
  reuses the same few buffers. The pool holds at most ``POOL_MAX_BYTES``, the most recently freed buffers
  (``release_pool`` empties it).

Below ``THRESHOLD_BYTES``, or where huge pages are not offered, ``empty`` is ``torch.empty``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import threading
import weakref

import numpy as np
import torch

THRESHOLD_BYTES = 8 << 20  # smaller buffers come from torch's allocator, which reuses them
POOL_MAX_BYTES = 1 << 30  # freed buffers kept for reuse, in all
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_pool: list[mmap.mmap] = []  # oldest first
_pooled_bytes = 0
_lock = threading.RLock()  # re-entrant: a finalizer may run (garbage collection) while this thread holds it


@functools.cache
def available() -> bool:
    """Whether this process can ask for transparent huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING, encoding="ascii") as fh:
            return "[never]" not in fh.read()
    except OSError:
        return False


def empty(shape: tuple[int, ...], dtype: torch.dtype, *, prefault: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor like ``torch.empty(shape, dtype=dtype)``, on huge pages when it is large.

    ``prefault``: a fresh mapping is written once (zeros, by torch's threads) so that no page faults are left
    for the caller's loops; a recycled one is already faulted in. The contents are undefined either way.
    """
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < THRESHOLD_BYTES or not available():
        return torch.empty(shape, dtype=dtype)
    buffer = _take(nbytes)
    fresh = buffer is None
    if buffer is None:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # advice refused: ordinary pages, still correct
            buffer.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(buffer, dtype=np.uint8)
    weakref.finalize(array, _give_back, buffer)  # runs when the last tensor on this memory is freed
    tensor = torch.from_numpy(array).view(dtype).view(shape)
    if fresh and prefault:
        tensor.view(torch.uint8).zero_()
    return tensor


def pooled_bytes() -> int:
    """Bytes of freed buffers kept for reuse."""
    return _pooled_bytes


def release_pool() -> None:
    """Unmap every pooled buffer (their memory goes back to the system)."""
    global _pooled_bytes
    with _lock:
        buffers = list(_pool)
        _pool.clear()
        _pooled_bytes = 0
    for buffer in buffers:
        with contextlib.suppress(BufferError):  # still exported by an array being freed: unmapped after it
            buffer.close()


def _take(nbytes: int) -> mmap.mmap | None:
    """The most recently pooled buffer of exactly ``nbytes``, taken out of the pool; None when there is none."""
    global _pooled_bytes
    with _lock:
        for index in range(len(_pool) - 1, -1, -1):
            if len(_pool[index]) == nbytes:
                _pooled_bytes -= nbytes
                return _pool.pop(index)
    return None


def _give_back(buffer: mmap.mmap) -> None:
    """Pool a freed buffer; the oldest ones are dropped (unmapped once unreferenced) beyond ``POOL_MAX_BYTES``."""
    global _pooled_bytes
    with _lock:
        _pool.append(buffer)
        _pooled_bytes += len(buffer)
        while _pooled_bytes > POOL_MAX_BYTES and _pool:
            _pooled_bytes -= len(_pool.pop(0))
