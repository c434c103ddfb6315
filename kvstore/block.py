"""The unit of storage: the attention state of a contiguous run of tokens for all layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvshelf.kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvshelf.kvstore.codec import PreparedPayload


@dataclass(frozen=True)
class KVBlock:
    """Keys and values of ``tokens`` consecutive tokens for every layer of one model.

    Attributes:
        keys: ``[layers, kv_heads, tokens, head_dim]``; RoPE already applied.
        values: ``[layers, kv_heads, tokens, value_head_dim]``: as the keys but for the head dim, which may differ
            (MLA models: transformers caches their compressed latent as keys, the rotated shared key part as values).
        token_ids: the ``tokens`` token ids this state was computed for.
        start_pos: absolute position of the first token (0 for position-independent chunks).
        fingerprint: the model fingerprint (see ``kvstore.fingerprint``).
        namespace: the tenant that owns the block.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    start_pos: int
    fingerprint: str
    namespace: str = "default"
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.values.dim() != 4:
            raise ConfigError(
                f"KVBlock keys/values must be 4-D [layers, kv_heads, tokens, head_dim]; "
                f"got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.keys.shape[:3] != self.values.shape[:3]:
            raise ConfigError(
                f"KVBlock keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} disagree"
            )
        if self.keys.dtype != self.values.dtype:
            raise ConfigError(f"KVBlock keys dtype {self.keys.dtype} != values dtype {self.values.dtype}")
        if len(self.token_ids) != self.keys.shape[2]:
            raise ConfigError(
                f"KVBlock has {len(self.token_ids)} token ids for {self.keys.shape[2]} tokens of state"
            )
        if self.start_pos < 0:
            raise ConfigError(f"KVBlock start_pos must be >= 0, got {self.start_pos}")

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of keys plus values in the block's own dtype."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass(frozen=True)
class PreparedBlock:
    """A stored block checked and parsed but not yet materialized (``TieredStore.get_prepared_many``).

    ``payload.write(keys_out, values_out)`` fills ``[layers, kv_heads, tokens, head_dim]`` tensors (for example
    slices of a cache being built), which lets a codec decode straight into the cache, and many blocks at once.
    ``shape`` is the keys' (a ``kvstore.codec.BlockShape``: ``shape.values`` is the values', whose head dim may
    differ, as in MLA models).
    """

    payload: PreparedPayload
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    token_ids: tuple[int, ...]
    start_pos: int
    fingerprint: str
    namespace: str = "default"

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]
