"""``zstd``: lossless. The model-dtype bytes of keys and values are byte-plane shuffled, then zstandard-compressed.

Shuffle: an ``n``-element tensor of ``itemsize``-byte values ``[n, itemsize]`` is transposed to byte planes
``[itemsize, n]`` (all low bytes, then the next byte...), which puts the slowly varying sign/exponent bytes
together and lets zstd find their redundancy (as in Blosc's shuffle filter). Error bound: exact (bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import zstandard

from compress._cast import numel
from compress.container import pack_sections, unpack_sections
from compress.raw import tensor_bytes, tensor_from_bytes
from compress.registry import Codec, register_codec
from kvstore.errors import CorruptBlockError


def shuffle(t: torch.Tensor) -> memoryview:
    """Byte planes of ``t``: ``[n, itemsize]`` bytes transposed to ``[itemsize, n]``."""
    t = t.detach().to("cpu").contiguous()
    planes = t.view(torch.uint8).reshape(-1, t.element_size()).t().contiguous()
    return tensor_bytes(planes)


def unshuffle(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    planes = tensor_from_bytes(memoryview(buf), torch.uint8, (itemsize, numel(shape)), copy=False)
    return planes.t().contiguous().reshape(-1).view(dtype).reshape(shape)


@register_codec
@dataclass
class ZstdCodec(Codec):
    """Lossless: byte-plane shuffle then zstd at ``level`` (1..22; negative levels down to -7 trade ratio for
    speed). Keys and values ``[layers, kv_heads, tokens, head_dim]`` are compressed as two frames."""

    name = "zstd"
    level: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {self.level!r}")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return pack_sections([compressor.compress(shuffle(keys)), compressor.compress(shuffle(values))])

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        frames = unpack_sections(payload, 2, self.name)
        expected = numel(shape) * torch.empty((), dtype=dtype).element_size()
        decompressor = zstandard.ZstdDecompressor()
        out = []
        for frame in frames:
            try:
                raw = decompressor.decompress(frame, max_output_size=expected)
            except zstandard.ZstdError as exc:
                raise CorruptBlockError(f"zstd payload does not decompress: {exc}") from exc
            if len(raw) != expected:
                raise CorruptBlockError(f"zstd frame holds {len(raw)} bytes, expected {expected} for {shape}")
            out.append(unshuffle(raw, dtype, shape))
        return out[0], out[1]
