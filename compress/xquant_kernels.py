"""Fused CPU loops of ``xquant``'s decode, compiled by numba; ``xquant`` falls back to numpy / torch without it.

Three loops where numpy and torch need several passes over memory:

* ``unpack_kernel(per)``: a class stream of ``per`` symbols a byte to int8 symbols with its escapes, one pass;
  a group of bytes without escapes (8 symbols, 24 when ``per`` is 3) is written as whole 8-byte words built from
  a per-byte table, a scalar store per symbol only around escapes (2.2x the byte-at-a-time loop);
* ``place_block``: a block's entropy-decoded symbols (per class, per layer, token-major) into each layer's
  ``[T, kept]`` symbol matrix, the left operand of the int8 matrix product;
* ``epilogue_kernel(heads, head_dim)``: a layer's product ``Z`` (``[T, C]``, int32 or float32) to the cache:
  column scales, block means, RoPE on the key half (HF ``rotate_half`` convention), keys and values written
  ``[kv_heads, T, head_dim]``: one pass instead of the five torch needs. Compiled per model geometry (the
  head sizes are compile-time constants, which lets LLVM vectorize the inner loops).

All run serially on the threads that call them (no numba thread pool beside torch's OpenMP one) and release the
GIL; a decode splits them over the caller and the threads of a ``worker_pool()`` that exit with it. They are
compiled on first use and kept in numba's on-disk cache (``cache=True``), so a later process loads them in
milliseconds; ``warm_up`` does that ahead of the first decode (``compress.xquant.bind_tables`` calls it).
``KVSHELF_NO_NUMBA=1`` in the environment turns them off (the fallback path), as tests do to compare both.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:  # numba is a dependency; numpy and torch stand in where it cannot be imported
    from numba import njit
except ImportError:  # pragma: no cover - exercised through AVAILABLE = False in the tests
    njit = None

AVAILABLE = njit is not None and os.environ.get("KVSHELF_NO_NUMBA", "") in ("", "0")
_lock = threading.Lock()
_warm: set[tuple[int, int]] = set()


def workers() -> int:
    """Threads the loops are split over: this process's CPUs (the loops release the GIL)."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


def run_split(task: Callable[[int, int], None], total: int, pool: ThreadPoolExecutor) -> None:
    """``task(first, last)`` over ``0..total`` cut into ``workers()`` ranges: the first on the calling thread, the
    others on ``pool`` (a ``worker_pool()`` the caller holds for a whole decode)."""
    parts = min(workers(), max(total, 1))
    if parts == 1:
        task(0, total)
        return
    bounds = [total * i // parts for i in range(parts + 1)]
    futures = [pool.submit(task, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    task(bounds[0], bounds[1])
    for future in futures:
        future.result()


def worker_pool() -> ThreadPoolExecutor:
    """Threads for one decode's ``run_split`` calls (use as a context manager: they exit with it).

    Not a pool kept for the process's life: measured here, idle threads that had run a decode's loops left every
    later forward pass of the model ~20-40 ms slower (torch's OpenMP worker did less of each step), which threads
    that exit do not; starting two threads costs ~0.1 ms per decode.
    """
    return ThreadPoolExecutor(max_workers=max(workers() - 1, 1), thread_name_prefix="kvshelf-xquant")


def _libc_memmove() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None).memmove
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not a POSIX libc
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
    return fn


_memmove = _libc_memmove() if njit is not None else None

if _memmove is not None:

    @njit(nogil=True, error_model="numpy")  # pyright: ignore[reportOptionalCall]  (calls libc: compiled per process)
    def _place(rows, counts, slot_offsets, widths, out_starts, start, tokens, out):  # pragma: no cover - numba
        source, target = rows.ctypes.data, out.ctypes.data
        pos = 0
        for c in range(counts.shape[0]):
            for layer in range(counts.shape[1]):
                n, width = counts[c, layer], widths[layer]
                if n == 0:
                    continue
                dst = out_starts[layer] + start * width + slot_offsets[c, layer]
                for _ in range(tokens):
                    _memmove(target + dst, source + pos, n)  # pyright: ignore[reportOptionalCall]
                    pos += n
                    dst += width


def place_block(rows: np.ndarray, counts: np.ndarray, slot_offsets: np.ndarray, widths: np.ndarray,
                out_starts: np.ndarray, start: int, tokens: int, out: np.ndarray) -> None:
    """Copy a block's symbols into the layers' token-major matrices held in ``out`` (flat int8).

    ``rows`` (flat int8): for each class ``c``, for each layer ``l``, a ``[tokens, counts[c, l]]`` row-major
    segment; it lands in layer ``l``'s ``[T, widths[l]]`` matrix (at ``out_starts[l]`` in ``out``), rows
    ``start..start + tokens - 1``, columns ``slot_offsets[c, l]..`` onwards.
    """
    if int(counts.sum()) * tokens != len(rows) or np.any(slot_offsets + counts > widths) or np.any(
            out_starts + (start + tokens) * widths > len(out)) or start < 0:
        raise ValueError("place_block: the segments do not fit the rows or the output")  # guards the raw copies
    if AVAILABLE and _memmove is not None and rows.flags.c_contiguous and out.flags.c_contiguous:
        _place(rows, counts, slot_offsets, widths, out_starts, start, tokens, out)
        return
    pos = 0
    for c in range(counts.shape[0]):
        for layer in range(counts.shape[1]):
            n, width, off = int(counts[c, layer]), int(widths[layer]), int(slot_offsets[c, layer])
            first = out_starts[layer] + start * width
            target = out[first : first + tokens * width].reshape(tokens, width)
            target[:, off : off + n] = rows[pos : pos + tokens * n].reshape(tokens, n)
            pos += tokens * n


# group of input bytes whose symbols fill whole 8-byte words: (bytes, symbols) per ``per``
GROUPS = {1: (8, 8), 2: (4, 8), 3: (8, 24), 4: (2, 8)}


@functools.lru_cache(maxsize=8)
def unpack_kernel(per: int) -> Callable[..., tuple[int, int]]:
    """The compiled unpacker of a stream of ``per`` symbols a byte: ``kernel(data, digits, has_escape, words,
    out, out_words, escape_values, escape, wide, wide_values, n_wide, offset) -> (escape, n_wide)``.

    ``data``: the packed bytes (``ceil(len(out) / per)``); ``digits``: ``[256, per]`` int8, each byte value's
    symbols, ``-128`` for the escape digit; ``has_escape``: ``[256]`` bool; ``words``: ``[256]`` uint64, each
    byte value's symbols as the low ``per`` bytes of a word; ``out_words``: the first ``len(out) // symbols``
    groups of ``out`` viewed as uint64 (``GROUPS[per]``: a group of input bytes whose symbols fill whole words),
    so a group without escapes is one to three word stores. Escape digits take the next of ``escape_values``
    (from index ``escape``): into ``out`` when it fits in int8, else ``out`` gets 0 and its flat position
    (``offset`` + index in ``out``) and value are appended to ``wide`` / ``wide_values`` at ``n_wide``.
    Returns the next escape index and wide count; escape ``-1`` when the digits outnumber ``escape_values``.
    """
    if njit is None:  # pragma: no cover - callers check AVAILABLE first
        raise RuntimeError("numba is not installed")
    group_bytes, group_symbols = GROUPS[per]
    shifts = tuple(np.uint64(8 * per * i) for i in range(group_bytes))  # typed: uint64 << uint64 stays uint64
    s8, s16, s24, s32, s40, s48, s56 = (np.uint64(8 * i) for i in range(1, 8))

    @njit(cache=True, nogil=True, error_model="numpy")
    def kernel(data, digits, has_escape, words, out, out_words, escape_values, escape, wide, wide_values, n_wide,
               offset):  # pragma: no cover - numba
        count = out.shape[0]
        n_escapes = escape_values.shape[0]
        groups = out_words.shape[0] * 8 // group_symbols
        n_bytes = (count + per - 1) // per
        b = 0
        while b < n_bytes:
            if b % group_bytes == 0 and b // group_bytes < groups:
                clean = True
                for i in range(group_bytes):
                    if has_escape[data[b + i]]:
                        clean = False
                if clean:
                    g = b // group_bytes
                    if per == 3:  # eight 24-bit pieces into three words
                        w0, w1, w2, w3 = words[data[b]], words[data[b + 1]], words[data[b + 2]], words[data[b + 3]]
                        w4, w5, w6, w7 = words[data[b + 4]], words[data[b + 5]], words[data[b + 6]], words[data[b + 7]]
                        out_words[3 * g] = w0 | (w1 << s24) | (w2 << s48)
                        out_words[3 * g + 1] = (w2 >> s16) | (w3 << s8) | (w4 << s32) | (w5 << s56)
                        out_words[3 * g + 2] = (w5 >> s8) | (w6 << s16) | (w7 << s40)
                    else:
                        word = words[data[b]]
                        for i in range(1, group_bytes):
                            word |= words[data[b + i]] << shifts[i]
                        out_words[g] = word
                    b += group_bytes
                    continue
            base = b * per
            for j in range(min(per, count - base)):
                symbol = digits[data[b], j]
                if symbol == -128:
                    if escape >= n_escapes or n_wide >= wide.shape[0]:
                        return -1, n_wide
                    value = escape_values[escape]
                    escape += 1
                    if -127 <= value <= 127:
                        symbol = value
                    else:
                        symbol = 0
                        wide[n_wide] = offset + base + j
                        wide_values[n_wide] = value
                        n_wide += 1
                out[base + j] = symbol
            b += 1
        return escape, n_wide

    return kernel


@functools.lru_cache(maxsize=8)
def epilogue_kernel(heads: int, head_dim: int) -> Callable[..., None]:
    """The compiled epilogue for ``heads`` kv heads of ``head_dim`` (even): ``kernel(z, scale, offsets,
    block_of, cos, sin, keys, values, first, last)`` writes tokens ``first..last - 1``.

    ``z``: ``[T * C]`` int32 or float32 (row-major ``[T, C]``, ``C = 2 * heads * head_dim``, keys first);
    ``scale``: ``[C]`` float32; ``offsets``: ``[blocks * C]`` float32 (each block's rematerialized means);
    ``block_of``: ``[T]`` int64; ``cos`` / ``sin``: ``[T * head_dim / 2]`` float32; ``keys`` / ``values``:
    ``[heads * T * head_dim]`` float32 (contiguous ``[heads, T, head_dim]``).
    """
    if njit is None:  # pragma: no cover - callers check AVAILABLE first
        raise RuntimeError("numba is not installed")
    mid, half = head_dim // 2, heads * head_dim
    width = 2 * half

    @njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
    def kernel(z, scale, offsets, block_of, cos, sin, keys, values, first, last):  # pragma: no cover - numba
        tokens = block_of.shape[0]
        for t in range(first, last):
            row = z[t * width : (t + 1) * width]
            mean = offsets[block_of[t] * width : (block_of[t] + 1) * width]
            c = cos[t * mid : (t + 1) * mid]
            s = sin[t * mid : (t + 1) * mid]
            for h in range(heads):
                base = h * head_dim
                out = (h * tokens + t) * head_dim
                k = keys[out : out + head_dim]
                v = values[out : out + head_dim]
                for i in range(mid):
                    a = np.float32(row[base + i]) * scale[base + i] + mean[base + i]
                    b = np.float32(row[base + mid + i]) * scale[base + mid + i] + mean[base + mid + i]
                    k[i] = a * c[i] - b * s[i]
                    k[mid + i] = b * c[i] + a * s[i]
                for d in range(head_dim):
                    j = half + base + d
                    v[d] = np.float32(row[j]) * scale[j] + mean[j]

    return kernel


def warm_up(heads: int, head_dim: int) -> None:
    """Compile (or load from numba's cache) the loops for one model geometry, once per process."""
    if not AVAILABLE or (heads, head_dim) in _warm:
        return
    with _lock:
        if (heads, head_dim) in _warm:
            return
        width, mid = 2 * heads * head_dim, head_dim // 2
        for per in (1, 2, 3, 4):
            group_bytes, group_symbols = GROUPS[per]
            data = np.frombuffer(np.zeros(group_bytes, np.uint8).tobytes(), np.uint8)  # read-only, as zstd's
            out = np.zeros(group_symbols + 8, np.int8)
            for at in (0, 1):  # the word view of a stream aligned and not (an odd token count shifts them)
                unpack_kernel(per)(data, np.zeros((256, per), np.int8), np.zeros(256, np.bool_),
                                   np.zeros(256, np.uint64), out[at : at + group_symbols],
                                   out[at : at + group_symbols].view(np.uint64),
                                   np.frombuffer(np.zeros(1, np.int32).tobytes(), np.int32), 0,
                                   np.zeros(1, np.int64), np.zeros(1, np.int32), 0, 0)
        place_block(np.zeros(2, np.int8), np.ones((1, 1), np.int64), np.zeros((1, 1), np.int64),
                    np.ones(1, np.int64), np.zeros(1, np.int64), 0, 2, np.zeros(2, np.int8))
        kernel = epilogue_kernel(heads, head_dim)
        for z in (np.zeros(width, np.int32), np.zeros(width, np.float32)):
            out = np.zeros(heads * head_dim, np.float32), np.zeros(heads * head_dim, np.float32)
            kernel(z, np.ones(width, np.float32), np.zeros(width, np.float32), np.zeros(1, np.int64),
                   np.ones(mid, np.float32), np.zeros(mid, np.float32), *out, 0, 1)
        _warm.add((heads, head_dim))
