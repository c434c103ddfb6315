"""Shared logic of the ``fp16`` and ``bf16`` codecs: keys and values cast to a 16-bit float type."""

from __future__ import annotations

import torch

from kvshelf.compress.container import expect_len, frame_bytes, pack_sections, unpack_sections
from kvshelf.compress.raw import tensor_bytes, tensor_from_bytes
from kvshelf.kvstore.codec import DecodedPayload, block_numel, key_shape, value_shape


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cast_payload_bytes(shape: tuple[int, ...]) -> int:
    """The exact payload size of a 16-bit cast codec (``fp16``, ``bf16``) for keys and values of ``shape``."""
    return frame_bytes(2) + block_numel(shape) * 2


def cast_encode(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> list[bytes | memoryview]:
    """Keys and values cast to ``dtype`` (finite values beyond its range saturate to its largest value)."""
    limit = torch.finfo(dtype).max

    def cast(t: torch.Tensor) -> memoryview:
        t = t.detach().to("cpu")
        if t.dtype != dtype and torch.finfo(t.dtype).max > limit:
            t = t.float().clamp(-limit, limit)
        return tensor_bytes(t.to(dtype))

    return pack_sections([cast(keys), cast(values)])


def cast_decode(
    payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, stored: torch.dtype, codec: str,
    copy: bool, *, verified: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    k_buf, v_buf = unpack_sections(payload, 2, codec, verified=verified)
    out = []
    for buf, what, part in ((k_buf, "keys", key_shape(shape)), (v_buf, "values", value_shape(shape))):
        t = tensor_from_bytes(expect_len(buf, numel(part) * 2, what, codec), stored, part,
                              copy=copy and dtype == stored)
        out.append(t if t.dtype == dtype else t.to(dtype))
    return out[0], out[1]


def cast_prepare(payload: memoryview, shape: tuple[int, int, int, int], stored: torch.dtype,
                 codec: str, *, verified: bool = False) -> DecodedPayload:
    """The payload checked, its keys and values as read-only ``stored``-dtype views of it (``[layers, kv_heads,
    tokens, head_dim]``): ``write`` casts them straight into the destination, nothing decoded in between."""
    keys, values = cast_decode(payload, shape, stored, stored, codec, copy=False, verified=verified)
    return DecodedPayload(keys, values)
