"""Large CPU buffers on transparent huge pages: decoding a cache into fresh memory faults 2 MiB at a time.

A 4,096-token SmolLM2 cache is ~190 MB of float32 written into fresh memory on every load; with 4 KiB pages
that is ~46,000 page faults (tens of milliseconds, more when the writes come from a tight loop). Anonymous
memory advised ``MADV_HUGEPAGE`` faults in 2 MiB pages instead, where the kernel offers transparent huge
pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``); elsewhere ``empty`` is
``torch.empty``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap

import torch

THRESHOLD_BYTES = 8 << 20  # smaller buffers come from torch's allocator, which reuses them
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor like ``torch.empty(shape, dtype=dtype)``, on huge pages when it is large."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < THRESHOLD_BYTES or not available():
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # advice refused: ordinary pages, still correct
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
