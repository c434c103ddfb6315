"""``sparse``: only the kept tokens of a block, plus which they are, with their KV in any inner codec.

For pruned or selected caches (StreamingLLM, H2O, SnapKV... see ``adapters``). How the kept tokens are given:
a codec only sees the keys and values, so **a dropped token is marked by NaN keys** (every key element of that
token, in every layer and head, is NaN; use ``mark_dropped`` to build such a block from kept indices). This works
per block through any tier configured with ``sparse``, with no per-block codec parameters.

Payload: a bitmap of the kept tokens (1 bit per token) and the inner codec's payload of the kept tokens'
``[layers, kv_heads, kept, head_dim]`` keys and values, in a ``container`` frame.

Decoding returns the original shape ``[layers, kv_heads, tokens, head_dim]`` with the dropped tokens filled with
``fill`` (NaN by default, so they are explicit and can never be mistaken for real state); ``kept_mask`` gives the
kept tokens back and ``compact_block`` turns a decoded block into the kept tokens only, with their original
absolute positions recorded in ``extra["positions"]`` (comma-separated).

Error bound: that of the inner codec on the kept tokens; dropped tokens decode to ``fill``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshelf.compress.bitpack import pack_bits, packed_len, unpack_bits
from kvshelf.compress.container import frame_bytes, pack_sections, unpack_sections
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.codec import (
    BlockShape,
    Codec,
    block_numel,
    get_codec,
    key_shape,
    payload_len_bounds,
    register_codec,
    value_head_dim,
    value_shape,
)
from kvshelf.kvstore.errors import CorruptBlockError

_FILLS = {"nan": float("nan"), "zero": 0.0}


def kept_mask(keys: torch.Tensor) -> torch.Tensor:
    """``[tokens]`` bool: tokens of ``keys [layers, kv_heads, tokens, head_dim]`` not marked dropped (all-NaN)."""
    if keys.shape[2] == 0:
        return torch.zeros(0, dtype=torch.bool)
    return ~torch.isnan(keys).permute(2, 0, 1, 3).reshape(keys.shape[2], -1).all(dim=1)


def mark_dropped(block: KVBlock, kept: torch.Tensor | list[int]) -> KVBlock:
    """A copy of ``block`` whose tokens not in ``kept`` (indices into the block, or a ``[tokens]`` bool mask) have
    NaN keys and values: what the ``sparse`` codec drops."""
    mask = torch.zeros(block.num_tokens, dtype=torch.bool)
    mask[torch.as_tensor(kept, dtype=torch.long) if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool
         else kept.nonzero().flatten()] = True
    keys, values = block.keys.clone(), block.values.clone()
    keys[:, :, ~mask] = float("nan")
    values[:, :, ~mask] = float("nan")
    return KVBlock(keys, values, block.token_ids, block.start_pos, block.fingerprint, block.namespace,
                   dict(block.extra))


def compact_block(block: KVBlock) -> KVBlock:
    """The kept tokens of a decoded ``sparse`` block only, ``extra["positions"]`` listing their absolute positions.

    ``start_pos`` stays the position of the block's first (possibly dropped) token.
    """
    mask = kept_mask(block.keys)
    index = mask.nonzero().flatten()
    positions = ",".join(str(block.start_pos + int(i)) for i in index)
    return KVBlock(
        block.keys[:, :, index].contiguous(), block.values[:, :, index].contiguous(),
        tuple(block.token_ids[int(i)] for i in index), block.start_pos, block.fingerprint, block.namespace,
        {**block.extra, "positions": positions},
    )


@register_codec
@dataclass
class SparseCodec(Codec):
    """Kept tokens (keys not all-NaN) of ``[layers, kv_heads, tokens, head_dim]`` in the codec ``inner`` with
    ``inner_params``; dropped tokens decode to ``fill`` (``"nan"`` or ``"zero"``)."""

    name = "sparse"
    inner: str = "fp16"
    inner_params: dict[str, Any] = field(default_factory=dict)
    fill: str = "nan"

    def __post_init__(self) -> None:
        if self.inner == self.name:
            raise ValueError("a sparse codec cannot nest another sparse codec")
        if not isinstance(self.inner_params, dict):
            raise ValueError(f"inner_params must be a dict, got {self.inner_params!r}")
        if self.fill not in _FILLS:
            raise ValueError(f"fill must be one of {sorted(_FILLS)}, got {self.fill!r}")
        self._inner = get_codec(self.inner, self.inner_params)  # CodecParamError for a bad inner codec

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None] | None:
        """The head and bitmap, plus the inner codec's bounds for 0 to all tokens kept."""
        inner = params.get("inner", "fp16")
        inner_params = params.get("inner_params", {})
        if inner == cls.name or not isinstance(inner, str) or not isinstance(inner_params, Mapping):
            return None
        layers, heads, tokens, dim = key_shape(shape)
        none_kept = payload_len_bounds(inner, inner_params, BlockShape((layers, heads, 0, dim), value_head_dim(shape)),
                                       itemsize)
        all_kept = payload_len_bounds(inner, inner_params, shape, itemsize)
        if none_kept is None or all_kept is None:
            return None
        fixed = frame_bytes(3) + 16 + packed_len(tokens, 1)
        return fixed + none_kept[0], None if all_kept[1] is None else fixed + all_kept[1]

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """The inner codec's decode of up to every token (its decoded kept tokens and its own working memory), or
        those kept tokens beside the outputs being filled, or (``prepare_at``) the decoded block kept for
        ``write``; plus the kept-token mask and indices (9 bytes per token)."""
        inner = get_codec(params["inner"], params["inner_params"])
        inner_workspace = type(inner).decode_workspace_bytes(inner.params(), shape, itemsize, payload_len)
        return max(inner_workspace, block_numel(shape) * itemsize) + 9 * shape[2]

    def params(self) -> dict[str, Any]:
        return {"inner": self.inner, "inner_params": dict(self.inner_params), "fill": self.fill}

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        mask = kept_mask(keys)
        index = mask.nonzero().flatten()
        inner = self._inner.encode(keys[:, :, index].contiguous(), values[:, :, index].contiguous())
        head = struct.pack("<QQ", keys.shape[2], len(index))
        return pack_sections([head, pack_bits(mask.to(torch.uint8), 1), b"".join(bytes(p) for p in inner)])

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layers, heads, tokens, dim = key_shape(shape)
        head, bitmap, inner = unpack_sections(payload, 3, self.name)
        if len(head) != 16 or struct.unpack("<QQ", head)[0] != tokens:
            raise CorruptBlockError(f"sparse payload is not a block of {tokens} tokens")
        mask = unpack_bits(bitmap, tokens, 1).bool()
        index = mask.nonzero().flatten()
        if len(index) != struct.unpack("<QQ", head)[1]:
            raise CorruptBlockError("sparse payload: the kept-token bitmap disagrees with its count")
        kept_keys, kept_values = self._inner.decode(
            inner, BlockShape((layers, heads, len(index), dim), value_head_dim(shape)), dtype, True)
        if self.fill == "nan" and not dtype.is_floating_point:
            raise CorruptBlockError(f"sparse blocks need a floating dtype, got {dtype}")
        out = []
        for kept, part in ((kept_keys, key_shape(shape)), (kept_values, value_shape(shape))):
            full = torch.full(part, _FILLS[self.fill], dtype=dtype)
            full[:, :, index] = kept
            out.append(full)
        return out[0], out[1]
