"""``fp16``: keys and values stored as IEEE half precision.

Error bound: each element is rounded to the nearest fp16, a relative error <= 2**-11 for |x| >= 2**-14
(absolute <= 2**-25 below); |x| > 65504 saturates to +-65504. Exact for fp16 input. Payload: 2 bytes per value
plus a 30-byte frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshelf.compress._cast import cast_decode, cast_encode
from kvshelf.kvstore.codec import Codec, register_codec


@register_codec
@dataclass
class Fp16Codec(Codec):
    """Keys and values ``[layers, kv_heads, tokens, head_dim]`` cast to fp16; decoded back to the block dtype."""

    name = "fp16"

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        return cast_encode(keys, values, torch.float16)

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast_decode(payload, shape, dtype, torch.float16, self.name, copy)
