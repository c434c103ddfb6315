"""``zstd``: lossless. The model-dtype bytes of keys and values are byte-plane shuffled, then zstandard-compressed.

Shuffle: an ``n``-element tensor of ``itemsize``-byte values ``[n, itemsize]`` is transposed to byte planes
``[itemsize, n]`` (all low bytes, then the next byte...), which puts the slowly varying sign/exponent bytes
together and lets zstd find their redundancy (as in Blosc's shuffle filter). Each plane is its own zstd frame,
or is stored as is when zstd would not make it smaller: on fp32 KV only the top (sign + exponent) plane
compresses, the mantissa planes are noise, so decoding them is a view of the payload, not a decompression.
Unshuffling is one ``numpy.stack`` into a preallocated buffer. Error bound: exact (bit for bit).

Payload sections: a flags section (one byte per plane: 1 zstd, 0 stored), then the ``itemsize`` planes of the
keys and the ``itemsize`` planes of the values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from kvshelf.compress._cast import numel
from kvshelf.compress.container import frame_bytes, pack_sections, unpack_sections
from kvshelf.compress.raw import tensor_bytes
from kvshelf.kvstore.codec import Codec, block_numel, key_shape, register_codec, value_shape
from kvshelf.kvstore.errors import CorruptBlockError

_KEEP_RAW = 0.97  # store a plane as is unless zstd makes it at least 3% smaller


def decompress_exact(frame: bytes | memoryview, size: int, what: str, codec: str) -> bytes:
    """The ``size`` bytes a zstd ``frame`` holds; ``CorruptBlockError`` naming ``codec`` and ``what`` otherwise.

    The frame's header must declare its content size, and declare ``size``, before anything is decompressed:
    ``zstandard`` allocates the declared content size whatever ``max_output_size`` says (a 32 KiB frame of zeros
    declaring 1 GiB is a 1 GiB allocation), so a frame declaring more than the block's shape allows is refused
    from its header. Our encoders always write the content size.
    """
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"{codec} payload: {what} is not a zstd frame: {exc}") from exc
    if declared != size:  # an unknown content size reads as 2**64 - 1
        raise CorruptBlockError(f"{codec} payload: {what} declares {declared} bytes, expected {size}")
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"{codec} payload: {what} does not decompress: {exc}") from exc
    if len(out) != size:
        raise CorruptBlockError(f"{codec} payload: {what} is {len(out)} bytes, expected {size}")
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shuffle(t: torch.Tensor) -> memoryview:
    """Byte planes of ``t``: ``[n, itemsize]`` bytes transposed to ``[itemsize, n]``."""
    t = t.detach().to("cpu").contiguous()
    planes = t.view(torch.uint8).reshape(-1, t.element_size()).t().contiguous()
    return tensor_bytes(planes)


def unshuffle_planes(planes: list[bytes | memoryview], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``shuffle`` from its ``itemsize`` planes of ``n`` bytes each (one copy, into a new tensor)."""
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    out = np.empty((n, len(planes)), dtype=np.uint8)
    np.stack([np.frombuffer(p, dtype=np.uint8) for p in planes], axis=1, out=out)
    return torch.from_numpy(out).view(dtype).reshape(shape)


def unshuffle(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``shuffle`` from its concatenated planes."""
    itemsize, n = _itemsize(dtype), numel(shape)
    view = memoryview(buf).cast("B")
    return unshuffle_planes([view[i * n : (i + 1) * n] for i in range(itemsize)], dtype, shape)


@register_codec
@dataclass
class ZstdCodec(Codec):
    """Lossless: byte-plane shuffle then zstd at ``level`` (1..22; negative levels down to -7 trade ratio for
    speed). Keys and values ``[layers, kv_heads, tokens, head_dim]`` are compressed plane by plane."""

    name = "zstd"
    level: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {self.level!r}")

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """``decode``: one tensor's decompressed planes beside the decoded keys (``prod(shape) * itemsize``);
        ``prepare_at``: the decoded tensors it keeps for ``write`` (``2 * prod(shape) * itemsize``, the larger). A
        decompression context (one-shot into a buffer of the frame's content size, no window buffer: ~0.2 MiB)
        is within ``DECODE_OVERHEAD_BYTES``."""
        return block_numel(shape) * itemsize

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None]:
        """At most every plane stored as is (a plane is compressed only when that makes it smaller)."""
        planes = 2 * itemsize
        least = frame_bytes(1 + planes) + planes
        return least, least + itemsize * block_numel(shape)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        flags, planes = bytearray(), []
        for t in (keys, values):
            itemsize, n = t.element_size(), t.numel()
            shuffled = shuffle(t)
            for i in range(itemsize):
                plane = shuffled[i * n : (i + 1) * n]
                packed = compressor.compress(plane) if n else b""
                use = bool(n) and len(packed) < _KEEP_RAW * n
                flags.append(1 if use else 0)
                planes.append(packed if use else plane)
        return pack_sections([bytes(flags), *planes])

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        itemsize = _itemsize(dtype)
        parts = unpack_sections(payload, 1 + 2 * itemsize, self.name)
        flags = bytes(parts[0])
        if len(flags) != 2 * itemsize or any(f not in (0, 1) for f in flags):
            raise CorruptBlockError(f"zstd payload: bad plane flags {flags!r}")
        out = []
        for half, part in enumerate((key_shape(shape), value_shape(shape))):  # keys, then values: one at a time
            n = numel(part)
            planes = [decompress_exact(frame, n, "a plane", self.name) if flag else frame  # checked: no more than n
                      for flag, frame in zip(flags[half * itemsize : (half + 1) * itemsize],
                                             parts[1 + half * itemsize : 1 + (half + 1) * itemsize], strict=True)]
            if any(len(plane) != n for plane in planes):
                raise CorruptBlockError(f"zstd plane holds the wrong number of bytes, expected {n} for {shape!r}")
            out.append(unshuffle_planes(planes, dtype, part))
            del planes
        return out[0], out[1]
