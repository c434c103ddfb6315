"""Keep the server's large buffers in the C heap instead of fresh ``mmap`` s (glibc only).

Every value the server receives or sends lands in a buffer of megabytes (gRPC's message, the Python ``bytes``);
glibc serves such sizes with a fresh ``mmap`` and unmaps them when freed, so each put or get of an 8 MiB block
faults in and zeroes 2,048 new pages. Measured (``perf``, a loop of 8 MiB gRPC gets on loopback): a third of
the CPU time was page faults and page clearing. With the mmap threshold raised above the largest message and the
heap not trimmed below ``keep_bytes``, freed buffers are reused instead. ``kvshelf serve`` calls
``keep_large_buffers()`` at start (its process is ours). A client process gets the same from its environment,
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864``
(``LARGE_BUFFER_TUNABLES``), or by calling ``keep_large_buffers()`` itself: kvshelf never changes the allocator of
a process it does not own. Measured in one process: a copy of 8 MiB into a new buffer, 6-9 ms with glibc's
defaults (an 8 MiB allocation is a fresh mapping every time: glibc raises its mmap threshold to the size of a
freed mapping, and a request of that same size is again mapped), 0.5 ms with these settings.

What the heap keeps is bounded, so that a server's resident memory stays flat under sustained load: once the free
memory at the top of a heap exceeds ``keep_bytes``, glibc returns it, and ``kvshelf serve`` limits glibc to
``SERVER_ARENAS`` heaps (its default is 8 per core, one per busy thread, each keeping its own peak). ``kvshelf
serve`` keeps what its calls in flight can hold (``server_keep_bytes``: 4 x its in-flight budget, 64 MiB to 1 GiB):
memory returned below that is faulted in again by the next burst, in whichever thread touches it first. Measured
with ``kvshelf bench abuse`` (a tenant sending oversized, padded and bomb puts at the server's limits, 32 MiB per
call, 64 MiB in flight): with one heap per thread and 1 GiB kept, the server's RSS grew by 254 MiB in the first
minute of abuse and by 100 MiB more in the four after it; with 2 heaps, by 90-120 MiB in all, 64 MiB or more kept
alike. With 64 MiB kept the heap was trimmed and regrown all along, and the honest tenant's p99 was 1.6-2.5 ms above
its p99 with the same abuse aimed at another server of the machine (``--elsewhere``, 2 runs); with 256-512 MiB
kept, 0.3-1.0 ms (4 runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MAX_HEAP_BUFFER_BYTES = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
KEEP_BYTES = 64 << 20
MAX_KEEP_BYTES = 1 << 30
#: each byte of a put in flight can sit in four buffers at once: gRPC's, the message's, the value's, the tier's copy
BUFFERS_PER_INFLIGHT_BYTE = 4
#: the heaps (glibc arenas) of a ``kvshelf serve`` process: its threads mostly wait on the GIL, so sharing two heaps
#: costs nothing measurable, and each heap keeps at most the peak its threads reached together
SERVER_ARENAS = 2
#: The same settings for a process started with them (a client): its ``GLIBC_TUNABLES`` environment variable.
LARGE_BUFFER_TUNABLES = (f"glibc.malloc.mmap_threshold={MAX_HEAP_BUFFER_BYTES}:"
                         f"glibc.malloc.trim_threshold={KEEP_BYTES}")


def server_keep_bytes(inflight_bytes: int) -> int:
    """The freed heap a server keeps: what its puts in flight (``inflight_bytes`` at most, all tenants) can hold,
    ``BUFFERS_PER_INFLIGHT_BYTE`` times over, within ``KEEP_BYTES`` and ``MAX_KEEP_BYTES``."""
    return min(MAX_KEEP_BYTES, max(KEEP_BYTES, BUFFERS_PER_INFLIGHT_BYTE * inflight_bytes))


def keep_large_buffers(max_buffer_bytes: int = MAX_HEAP_BUFFER_BYTES, keep_bytes: int = KEEP_BYTES,
                       arenas: int | None = None) -> bool:
    """Serve buffers up to ``max_buffer_bytes`` from the heap and keep up to ``keep_bytes`` of freed heap (per
    heap); with ``arenas``, let the process's threads share at most that many heaps (call it before threads start);
    return whether it took effect (False, and nothing changed, off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, max_buffer_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes))
    if ok and arenas is not None:
        ok = bool(mallopt(_M_ARENA_MAX, arenas))
    if not ok:
        log.debug("mallopt refused the large-buffer settings; the allocator keeps its defaults")
    return ok
