"""``fp16``: keys and values stored as IEEE half precision.

Error bound: each element is rounded to the nearest fp16, a relative error <= 2**-11 for |x| >= 2**-14
(absolute <= 2**-25 below); |x| > 65504 saturates to +-65504. Exact for fp16 input. Payload: 2 bytes per value
plus a 30-byte frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvshelf.compress._cast import cast_decode, cast_encode, cast_payload_bytes, cast_prepare
from kvshelf.kvstore.codec import Codec, DecodedPayload, register_codec


@register_codec
@dataclass
class Fp16Codec(Codec):
    """Keys and values ``[layers, kv_heads, tokens, head_dim]`` cast to fp16; decoded back to the block dtype."""

    name = "fp16"

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None]:
        n = cast_payload_bytes(shape)
        return n, n

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """None: ``decode`` casts views of the payload into the decoded tensors, ``prepare_at`` keeps the views."""
        return 0

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        return cast_encode(keys, values, torch.float16)

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast_decode(payload, shape, dtype, torch.float16, self.name, copy)

    def prepare_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, start_pos: int, *,
        verified: bool = False,
    ) -> DecodedPayload:
        return cast_prepare(payload, shape, torch.float16, self.name, verified=verified)
