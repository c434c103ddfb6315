"""Keep the server's large buffers in the C heap instead of fresh ``mmap`` s (glibc only).

Every value the server receives or sends lands in a buffer of megabytes (gRPC's message, the Python ``bytes``);
glibc serves such sizes with a fresh ``mmap`` and unmaps them when freed, so each put or get of an 8 MiB block
faults in and zeroes 2,048 new pages. Measured (``perf``, a loop of 8 MiB gRPC gets on loopback): a third of
the CPU time was page faults and page clearing. With the mmap threshold raised above the largest message and the
heap not trimmed below ``keep_bytes``, freed buffers are reused instead. ``kvshelf serve`` calls
``keep_large_buffers()`` at start (its process is ours). A client process gets the same from its environment,
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824``
(``LARGE_BUFFER_TUNABLES``), or by calling ``keep_large_buffers()`` itself: kvshelf never changes the allocator of
a process it does not own. Measured in one process: a copy of 8 MiB into a new buffer, 6-9 ms with glibc's
defaults (an 8 MiB allocation is a fresh mapping every time: glibc raises its mmap threshold to the size of a
freed mapping, and a request of that same size is again mapped), 0.5 ms with these settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
MAX_HEAP_BUFFER_BYTES = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
KEEP_BYTES = 1 << 30
#: The same settings for a process started with them (a client): its ``GLIBC_TUNABLES`` environment variable.
LARGE_BUFFER_TUNABLES = (f"glibc.malloc.mmap_threshold={MAX_HEAP_BUFFER_BYTES}:"
                         f"glibc.malloc.trim_threshold={KEEP_BYTES}")


def keep_large_buffers(max_buffer_bytes: int = MAX_HEAP_BUFFER_BYTES, keep_bytes: int = KEEP_BYTES) -> bool:
    """Serve buffers up to ``max_buffer_bytes`` from the heap and keep up to ``keep_bytes`` of freed heap; return
    whether it took effect (False, and nothing changed, off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, max_buffer_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes))
    if not ok:
        log.debug("mallopt refused the large-buffer settings; the allocator keeps its defaults")
    return ok
