"""The codec base and registry: a codec turns the keys and values of a block into bytes and back.

A tier's configuration names a codec and its parameters; ``get_codec`` builds it. Codecs are dataclasses
whose fields are their parameters, so unknown or invalid parameters are caught with a clear error.

The base lives in ``kvstore`` (the store encodes and decodes through it) and the codecs in ``kvshelf.compress``,
which imports this module: dependencies point one way. The built-in codecs are registered on the first lookup
(``get_codec``, ``available_codecs``, ``register_codec``), which imports ``kvshelf.compress``.
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from kvshelf.kvstore.errors import CodecParamError, UnknownCodecError

_REGISTRY: dict[str, type[Codec]] = {}
#: a codec that does not state its decode working memory (``Codec.decode_workspace_bytes``) is assumed to need
#: this many times the block's decoded size
DEFAULT_WORKSPACE_FACTOR = 4
#: what one decode may allocate beyond its decoded size and its ``decode_workspace_bytes``, whatever the block:
#: library contexts (a zstd decompressor), temporaries allocated a fixed-size chunk at a time, cache entries of
#: bounded caches (``cachegen``'s flag models). Not a per-block cost: left out of ``decode_cost_bytes``, so a small
#: bound on blocks (a server's max block) still admits small blocks.
DECODE_OVERHEAD_BYTES = 16 << 20
_BUILTINS = "kvshelf.compress"  # importing it registers the built-in codecs
_builtins_loaded = False


def _registry() -> dict[str, type[Codec]]:
    """The registry, with the built-in codecs in it: ``kvshelf.compress`` is imported on the first call.

    While it imports, its own ``register_codec`` calls come back here and get the partly filled registry; another
    thread's call waits on the import lock until the import is done.
    """
    global _builtins_loaded
    if not _builtins_loaded:
        module = importlib.import_module(_BUILTINS)
        _builtins_loaded = not getattr(getattr(module, "__spec__", None), "_initializing", False)
    return _REGISTRY


#: a codec class, as ``register_codec`` returns it unchanged
CodecClass = TypeVar("CodecClass", bound="type[Codec]")


class PreparedPayload(ABC):
    """A block's payload, checked and parsed (``Codec.prepare_at``), that writes its tensors into given memory.

    Parsing (and entropy decoding) happens in ``prepare_at`` and raises ``CorruptBlockError``; ``write_run``
    only computes, so a caller can check every block of a prefix before it allocates the destination.
    """

    num_tokens: int
    #: whether ``write`` / ``write_run`` take destinations on any device (a GPU's: the codec decodes there, or
    #: copies host tensors there); False: CPU destinations only (``adapters.cache_bridge`` stages such runs)
    writes_to_device: ClassVar[bool] = False

    @abstractmethod
    def write(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write the block's keys and values into ``keys_out`` / ``values_out`` (``[layers, kv_heads, tokens,
        head_dim]``, possibly strided views of a larger cache, any floating dtype)."""

    @classmethod
    def write_run(cls, run: Sequence[PreparedPayload], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write consecutive blocks of this class, their tokens one after the other along dim 2 of the outputs.

        Codecs that decode faster over many tokens at once (one matrix product per layer) override this.
        """
        write_each(run, keys_out, values_out)


def write_each(run: Sequence[PreparedPayload], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """``write`` every block of ``run`` into its slice of ``keys_out`` / ``values_out`` (tokens along dim 2)."""
    start = 0
    for part in run:
        end = start + part.num_tokens
        part.write(keys_out[:, :, start:end], values_out[:, :, start:end])
        start = end


class DecodedPayload(PreparedPayload):
    """A payload already decoded to tensors (the default of ``Codec.prepare_at``): ``write`` copies them, to any
    device (``writes_to_device``)."""

    writes_to_device = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.num_tokens = int(keys.shape[2])

    def write(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        keys_out.copy_(self.keys)
        values_out.copy_(self.values)


class Codec(ABC):
    """Encodes ``keys`` and ``values`` shaped ``[layers, kv_heads, tokens, head_dim]`` to a payload.

    Subclasses are dataclasses; their fields are the codec's parameters. ``needs_model`` marks codecs that
    need the model's weights to decode (these are decoded in ``adapters``).

    Keys and values may differ in head dim (MLA): every ``shape`` a method receives is a ``BlockShape`` (the keys'
    4-tuple plus ``value_head_dim``; read the values' with ``value_shape``). A codec that cannot hold such a
    block refuses it in ``encode`` with ``ConfigError`` naming both shapes.
    """

    name: ClassVar[str]
    needs_model: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    @abstractmethod
    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        """Return the payload as a list of byte buffers (concatenated by the caller, never copied twice)."""

    @abstractmethod
    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild ``(keys, values)`` of ``shape`` in ``dtype``; raise ``CorruptBlockError`` on a bad payload.

        With ``copy=False`` the tensors may be read-only views of ``payload``.
        """

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None] | None:
        """``(least, most)`` payload bytes (``most`` None: unbounded) of a block of ``shape`` whose dtype has
        ``itemsize`` bytes, encoded with ``params`` (as a header carries them, unchecked); ``None`` when the codec
        cannot state them. O(1): ``verify_block`` calls it for every block it checks."""
        return None

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """Peak bytes that decoding a block of ``shape`` (keys and values ``[layers, kv_heads, tokens, head_dim]``)
        whose dtype has ``itemsize`` bytes, encoded with ``params`` (the codec's own, checked: ``codec.params()``)
        in a payload of ``payload_len`` bytes, allocates beyond its decoded keys and values, on every decode path:
        ``decode_at``, and ``prepare_at`` plus ``write`` into a caller's tensors (what ``prepare_at`` keeps for
        ``write`` counts). From the header alone, an upper bound whatever the payload holds:
        ``kvstore.encoding.decode_cost_bytes`` adds it to the decoded size, and every "may I decode this" check
        compares that to its bound before anything is allocated. It must grow at most in proportion to the
        decoded size and the payload, never with a parameter alone; fixed costs within
        ``DECODE_OVERHEAD_BYTES`` are left out.

        Each codec states its own (the tests measure them); this default, for a codec that does not, assumes
        ``DEFAULT_WORKSPACE_FACTOR`` times the decoded size.
        """
        return DEFAULT_WORKSPACE_FACTOR * block_numel(shape) * itemsize

    def encode_at(self, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> list[bytes | memoryview]:
        """``encode`` of a block whose first token is at position ``start_pos`` (codecs that need it override)."""
        return self.encode(keys, values)

    def decode_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode`` of a block whose first token is at position ``start_pos`` (codecs that need it override)."""
        return self.decode(payload, shape, dtype, copy)

    def prepare_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, start_pos: int, *,
        verified: bool = False,
    ) -> PreparedPayload:
        """Check and parse ``payload`` for a later ``write`` into a cache; ``CorruptBlockError`` when damaged.

        The default decodes now (tensors may be views of ``payload``, which must outlive the result); codecs
        whose decode is cheaper straight into the destination override it. ``verified``: the payload's bytes were
        checked by the block's checksum (``kvstore.encoding.prepare_block``): a codec may skip its own checksum
        (``compress.container.unpack_sections``), never its structural checks.
        """
        return DecodedPayload(*self.decode_at(payload, shape, dtype, False, start_pos))


def register_codec(cls: CodecClass) -> CodecClass:
    """Class decorator: make ``cls`` available under ``cls.name`` (a later registration of a name wins)."""
    _registry()[cls.name] = cls
    return cls


def payload_len_bounds(
    name: str, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
) -> tuple[int, int | None] | None:
    """``Codec.payload_bounds`` of the codec ``name`` (``None`` for an unknown codec or parameters it cannot
    read: those fail when the block is decoded)."""
    cls = _registry().get(name)
    if cls is None or not isinstance(params, Mapping):
        return None
    try:
        return cls.payload_bounds(params, shape, itemsize)
    except (TypeError, ValueError, KeyError, OverflowError):
        return None


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` (a Python int: no overflow for any declared shape)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


class BlockShape(tuple):
    """The shape of a block: the keys' ``[layers, kv_heads, tokens, head_dim]`` (it *is* that 4-tuple, so code that
    indexes it reads the keys' dims), plus ``value_head_dim``, the values' head dim (the keys' unless they differ:
    an MLA model's keys are ``qk_nope_head_dim + qk_rope_head_dim`` wide, its values ``v_head_dim``).

    What every codec method receives as ``shape`` (``value_shape`` and ``block_numel`` read it, and a plain
    4-tuple too, whose values are the keys' shape). Equality is the tuple's: compare ``values`` as well.
    """

    value_head_dim: int

    def __new__(cls, shape: Sequence[int], value_head_dim: int | None = None) -> BlockShape:
        self = super().__new__(cls, (int(s) for s in shape))
        if len(self) != 4:
            raise ValueError(f"a block shape is [layers, kv_heads, tokens, head_dim], got {list(self)}")
        found = getattr(shape, "value_head_dim", self[3]) if value_head_dim is None else value_head_dim
        self.value_head_dim = int(found)
        return self

    @property
    def keys(self) -> tuple[int, int, int, int]:
        return tuple(self)  # type: ignore[return-value]

    @property
    def values(self) -> tuple[int, int, int, int]:  # type: ignore[override]
        return (self[0], self[1], self[2], self.value_head_dim)

    @property
    def same_dims(self) -> bool:
        return self.value_head_dim == self[3]

    def __repr__(self) -> str:
        return describe_shape(self)

    def __reduce__(self):  # noqa: ANN204 - copy / pickle keep the values' head dim
        return (BlockShape, (tuple(self), self.value_head_dim))


def block_shape(keys_shape: Sequence[int], values_shape: Sequence[int] | None = None) -> BlockShape:
    """The ``BlockShape`` of keys and values of these shapes; ``ValueError`` when they differ in more than the
    head dim (layers, kv heads and tokens are shared)."""
    keys_shape = tuple(int(s) for s in keys_shape)
    if values_shape is None:
        return BlockShape(keys_shape)
    values_shape = tuple(int(s) for s in values_shape)
    if len(keys_shape) != 4 or len(values_shape) != 4 or keys_shape[:3] != values_shape[:3]:
        raise ValueError(f"keys {list(keys_shape)} and values {list(values_shape)} must share [layers, kv_heads, "
                         f"tokens] (only the head dim may differ)")
    return BlockShape(keys_shape, values_shape[3])


def value_head_dim(shape: Sequence[int]) -> int:
    """The values' head dim of ``shape`` (a ``BlockShape``, or a plain 4-tuple whose values are its keys')."""
    return int(getattr(shape, "value_head_dim", shape[3]))


def value_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """The values' ``[layers, kv_heads, tokens, head_dim]`` of ``shape`` (see ``value_head_dim``)."""
    return (int(shape[0]), int(shape[1]), int(shape[2]), value_head_dim(shape))


def key_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """The keys' ``[layers, kv_heads, tokens, head_dim]`` of ``shape`` (a plain tuple)."""
    return (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))


def block_numel(shape: Sequence[int]) -> int:
    """Elements of a block's keys plus values of ``shape`` (``2 * numel(shape)`` when they share the head dim)."""
    return numel(key_shape(shape)) + numel(value_shape(shape))


def describe_shape(shape: Sequence[int]) -> str:
    """``[l, h, t, d]`` for keys and values of one shape, else ``keys [l, h, t, dk], values [l, h, t, dv]``."""
    keys, values = key_shape(shape), value_shape(shape)
    return str(list(keys)) if keys == values else f"keys {list(keys)}, values {list(values)}"


def available_codecs() -> list[str]:
    return sorted(_registry())


def get_codec(name: str, params: Mapping[str, Any] | None = None) -> Codec:
    """Build the codec ``name`` with ``params``; raise ``UnknownCodecError`` / ``CodecParamError``."""
    cls = _registry().get(name)
    if cls is None:
        raise UnknownCodecError(f"unknown codec {name!r}; available codecs: {', '.join(available_codecs())}")
    params = dict(params or {})
    allowed = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(params) - allowed)
    if unknown:
        accepted = ", ".join(sorted(allowed)) or "none"
        raise CodecParamError(f"codec {name!r} got unknown parameter(s) {unknown}; it accepts: {accepted}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise CodecParamError(f"codec {name!r}: invalid parameters {params}: {exc}") from exc
