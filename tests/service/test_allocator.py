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
