"""Vectorised bit packing of small unsigned codes and fp16 side information (no Python loops over values)."""

from __future__ import annotations

import numpy as np
import torch

from kvshelf.compress.raw import tensor_bytes, tensor_from_bytes
from kvshelf.kvstore.errors import CorruptBlockError


def packed_len(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits (1, 2, 4 or 8) take once packed."""
    per = 8 // bits
    return (count + per - 1) // per


def pack_bits(codes: torch.Tensor, bits: int) -> memoryview:
    """Pack a flat uint8 tensor of codes ``< 2**bits`` (bits in 1, 2, 4, 8), little-endian within each byte."""
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return tensor_bytes(codes)
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grid = codes.view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return tensor_bytes((grid << shifts).sum(dim=1).to(torch.uint8))


def unpack_bits(buf: memoryview, count: int, bits: int) -> torch.Tensor:
    """The ``count`` codes packed in ``buf`` as a flat uint8 tensor; ``CorruptBlockError`` on a length mismatch."""
    if len(buf) != packed_len(count, bits):
        raise CorruptBlockError(f"packed codes are {len(buf)} bytes, expected {packed_len(count, bits)}")
    if bits == 8:
        return tensor_from_bytes(buf, torch.uint8, (len(buf),), copy=False)
    spread = np.take(_SPREAD[bits], np.frombuffer(buf, dtype=np.uint8))  # one table look-up per byte
    return torch.from_numpy(spread.view(np.uint8)[:count])


def _spread_tables() -> dict[int, np.ndarray]:
    """For 1-, 2- and 4-bit codes: the ``8 // bits`` codes of every byte value, one per byte, as one word."""
    tables = {}
    for bits, dtype in ((1, "<u8"), (2, "<u4"), (4, "<u2")):
        per = 8 // bits
        codes = (np.arange(256)[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
        tables[bits] = np.ascontiguousarray(codes.astype(np.uint8)).view(dtype).reshape(256)
    return tables


_SPREAD = _spread_tables()


def half_bytes(t: torch.Tensor) -> memoryview:
    """fp16 bytes of ``t``."""
    return tensor_bytes(t.to(torch.float16))


def half_from(buf: memoryview, shape: tuple[int, ...], what: str, codec: str) -> torch.Tensor:
    """A float32 tensor from fp16 bytes, after checking the length."""
    n = 1
    for s in shape:
        n *= s
    if len(buf) != 2 * n:
        raise CorruptBlockError(f"{codec} payload: {what} is {len(buf)} bytes, expected {2 * n}")
    return tensor_from_bytes(buf, torch.float16, shape, copy=False).float()
