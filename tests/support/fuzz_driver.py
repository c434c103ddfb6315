"""The driver the fuzz targets share (``fuzz_wire.py``, ``fuzz_bulk.py``): byte-level mutation, and a ``main`` that
runs atheris with coverage guidance from the parsers' module when it is installed, else a seeded mutation loop."""

from __future__ import annotations

import inspect
import random
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def mutate(raw: bytes, rng: random.Random) -> bytes:
    """``raw`` with a few random byte-level changes (flip, set, insert, delete, truncate, duplicate a slice)."""
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randint(0, len(out))
        kind = rng.randrange(6)
        if kind == 0 and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif kind == 1 and pos < len(out):
            out[pos] = rng.randrange(256)
        elif kind == 2:
            out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif kind == 3:
            del out[pos:pos + rng.randint(1, 4)]
        elif kind == 4:
            del out[pos:]
        else:
            out[pos:pos] = out[rng.randint(0, pos):pos]
    return bytes(out)


def fuzz_main(target: Callable[[bytes], None], seeds: Sequence[bytes], parsers: ModuleType, done: str) -> None:
    """Run atheris on ``target`` (instrumenting the functions of ``parsers``) when it is installed; else
    ``target`` on mutations of ``seeds`` (rounds: the first argument, default 100,000), then print
    ``done.format(rounds=...)``."""
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is None:
        rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 100_000
        rng = random.Random(0)
        for _ in range(rounds):
            target(mutate(rng.choice(seeds), rng))
        print(done.format(rounds=rounds))
        return
    for function in vars(parsers).values():  # coverage guidance from the parsers' own code
        if inspect.isfunction(function) and function.__module__ == parsers.__name__:
            atheris.instrument_func(function)
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()
