"""Decoding many encoded values at once: each value's result or the exception it raised, large batches on a
few short-lived threads."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
#: below this many bytes in all, values are decoded on the caller's thread
PARALLEL_MIN_BYTES = 1 << 20


def decode_all(decode: Callable[[bytes, bytes], T], keys: Sequence[bytes], values: Sequence[bytes | None],
               *, parallel: bool) -> list[T | BaseException | None]:
    """``decode`` every present value: the result, or the exception it raised (``None`` for a missing value).

    With ``parallel``, several large values are decoded by up to 4 threads: for decoders that do no torch work
    (checksums, zstd, numpy and numba release the GIL), so no second OpenMP team competes with the caller's. The
    threads exit when the call ends (no idle pool is kept beside the caller's model).
    """

    def one(key: bytes, value: bytes | None) -> T | BaseException | None:
        if value is None:
            return None
        try:
            return decode(key, value)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller, which sorts them out
            return exc

    present = [v for v in values if v is not None]
    if not parallel or len(present) < 2 or sum(len(v) for v in present) < PARALLEL_MIN_BYTES:
        return [one(k, v) for k, v in zip(keys, values, strict=True)]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvshelf-decode") as pool:
        return list(pool.map(one, keys, values))
