"""service/allocator.py: the glibc settings that keep large buffers in the heap take effect (or report that not)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, sys
from kvshelf.service.allocator import keep_large_buffers
if sys.argv[1] == "tuned":
    assert keep_large_buffers() is True
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(24 << 20)
libc.free(first)
second = libc.malloc(24 << 20)
print("same" if first == second else "moved")
"""


def _probe(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_keep_large_buffers_reuses_freed_buffers():
    """A fresh process maps a 24 MiB buffer and unmaps it when freed (the next one is a new mapping, whose pages
    fault in again); after keep_large_buffers() the freed buffer itself comes back from the heap."""
    assert _probe("default") == "moved"
    assert _probe("tuned") == "same"


KEEP_PROBE = """
import ctypes, ctypes.util, sys
from kvshelf.service.allocator import keep_large_buffers
assert keep_large_buffers(keep_bytes=int(sys.argv[1])) is True
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
buffers = [libc.malloc(24 << 20) for _ in range(8)]
for buffer in buffers:
    ctypes.memset(buffer, 1, 24 << 20)
for buffer in reversed(buffers):
    libc.free(buffer)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(int(status["RssAnon"].split()[0]) << 10)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_the_heap_keeps_freed_memory_up_to_keep_bytes():
    """192 MiB freed at the top of the heap: returned to the system with 64 MiB kept, kept with 512 MiB."""
    def anon_after_free(keep_bytes: int) -> int:
        out = subprocess.run([sys.executable, "-c", KEEP_PROBE, str(keep_bytes)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        return int(out.strip())

    assert anon_after_free(64 << 20) < 100 << 20
    assert anon_after_free(512 << 20) > 180 << 20


def test_a_server_keeps_four_times_its_inflight_budget_within_bounds():
    from kvshelf.service.allocator import KEEP_BYTES, MAX_KEEP_BYTES, server_keep_bytes
    from kvshelf.service.config import ServeConfig
    from kvshelf.service.server import ServerLimits

    assert server_keep_bytes(64 << 20) == 256 << 20
    assert server_keep_bytes(1 << 20) == KEEP_BYTES
    assert server_keep_bytes(ServerLimits().inflight_bytes) == MAX_KEEP_BYTES  # 2 x the default 1 GiB per call
    assert ServerLimits(max_call_bytes=32 << 20).inflight_bytes == 64 << 20
    assert ServerLimits(max_call_bytes=32 << 20, max_inflight_bytes=8 << 20).inflight_bytes == 8 << 20
    assert ServeConfig().server_limits().inflight_bytes == ServerLimits().inflight_bytes
