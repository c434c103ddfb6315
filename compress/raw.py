"""``raw``: keys and values in the block's own dtype, byte for byte (no compression)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvshelf.kvstore.codec import Codec, block_numel, key_shape, numel, register_codec, value_shape
from kvshelf.kvstore.errors import CorruptBlockError


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous first)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().data.cast("B") if t.numel() else memoryview(b"")


def tensor_from_bytes(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], copy: bool) -> torch.Tensor:
    """Interpret ``buf`` as a tensor; a view when ``copy`` is False (read-only memory: do not write to it)."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable buffers: we never write through the view
        t = torch.frombuffer(buf, dtype=dtype).view(shape)
    return t.clone() if copy else t


@register_codec
@dataclass
class RawCodec(Codec):
    """Keys then values, contiguous, in the model dtype. Payload bytes = L * H * T * (Dk + Dv) * itemsize."""

    name = "raw"

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None]:
        n = block_numel(shape) * itemsize
        return n, n

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """None: the decoded tensors are copies (or views) of the payload, ``prepare_at`` keeps views."""
        return 0

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        return [tensor_bytes(keys), tensor_bytes(values)]

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        k_shape, v_shape = key_shape(shape), value_shape(shape)
        half = numel(k_shape) * itemsize
        total = half + numel(v_shape) * itemsize
        if len(payload) != total:
            raise CorruptBlockError(f"raw payload is {len(payload)} bytes, expected {total} for {shape!r}")
        return (
            tensor_from_bytes(payload[:half], dtype, k_shape, copy),
            tensor_from_bytes(payload[half:], dtype, v_shape, copy),
        )
