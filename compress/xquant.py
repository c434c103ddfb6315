"""``xquant``: the KV cache stored as a quantized, entropy-coded latent of the layer input, rematerialized at load.

After XQuant (Tomar et al., "XQuant: Breaking the Memory Wall for LLM Inference with KV Cache Rematerialization",
2025): pre-RoPE ``[K | V]`` per token projected on a latent basis (``XQuantTables``), one uniform step, packed
symbols Huffman-coded by zstd, sinks in fp16; one matrix product per layer at load. Keys, values:
``[layers, kv_heads, tokens, head_dim]``. The design, parameters and error bound: docs/codecs.md, "How xquant works".
A destination off the CPU (a GPU cache) is rematerialized there (``write_portable``, torch ops on its device;
tests run it on the CPU with ``write_run(..., prefer_portable=True)``).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import zstandard

from kvshelf.compress import device as devices
from kvshelf.compress import hugepages, xquant_kernels
from kvshelf.compress.container import expect_len, pack_sections, unpack_sections
from kvshelf.compress.raw import tensor_bytes
from kvshelf.compress.zstd import decompress_exact
from kvshelf.kvstore.codec import Codec, PreparedPayload, numel, register_codec, write_each
from kvshelf.kvstore.errors import CodecParamError, ConfigError, CorruptBlockError

NAME = "xquant"
_FORMAT = 2  # 2: streams token-major within each (class, layer); 1 was component-major
_HEAD = struct.Struct("<BHHI")  # format, tokens, sinks, escapes
# (symbols per byte, half range): a byte holds ``per`` digits of base ``2 * half + 2``, the last digit an escape
# (the symbol is then the next value of the escapes section): 4**4, 6**3, 16**2 and 256 codes
_SCHEMES: tuple[tuple[int, int], ...] = ((4, 1), (3, 2), (2, 7), (1, 127))
# a component goes to the first class whose bound exceeds its calibration spread / step
_CLASS_BOUNDS = (0.4, 0.9, 2.6, math.inf)
_SECTIONS = 4 + len(_SCHEMES)  # head, means, sinks, escapes, one stream per class
_ESCAPE = -128  # the escape digit once unpacked (int8)
_HALF_MAX = 65504.0
_SYMBOL_LIMIT = 1 << 30
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, chain_log=6, hash_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)


class XQuantUnboundError(ConfigError):
    """An ``xquant`` block whose model tables are not bound in this process (the model's weights are needed)."""


@dataclass(frozen=True)
class XQuantTables:
    """What ``xquant`` needs of a model: the latent basis, calibration spreads and RoPE.

    ``basis``: ``[layers, C, C]`` float32, orthonormal columns; a token's latent is ``[K_pre | V] @ basis``
    with ``K_pre`` the pre-RoPE keys of all kv heads concatenated (``C = 2 * kv_heads * head_dim``).
    ``sigma``: ``[layers, C]`` float32, each latent component's spread on the calibration text.
    ``inv_freq``: ``[head_dim // 2]`` float32 RoPE inverse frequencies (HF ``rotate_half`` convention) and
    ``attention_scaling`` the factor HF applies to cos and sin.
    """

    basis: torch.Tensor
    sigma: torch.Tensor
    inv_freq: torch.Tensor
    kv_heads: int
    head_dim: int
    attention_scaling: float = 1.0
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        layers, width = self.basis.shape[0], 2 * self.kv_heads * self.head_dim
        if self.basis.shape != (layers, width, width) or self.sigma.shape != (layers, width):
            raise ConfigError(f"xquant tables: basis {tuple(self.basis.shape)} / sigma {tuple(self.sigma.shape)} do "
                              f"not fit {self.kv_heads} kv heads of dim {self.head_dim}")
        if self.head_dim % 2 or self.inv_freq.shape != (self.head_dim // 2,):
            raise ConfigError(f"xquant tables: inv_freq {tuple(self.inv_freq.shape)} for head_dim {self.head_dim}")
        for name in ("basis", "sigma", "inv_freq"):
            object.__setattr__(self, name, getattr(self, name).detach().to("cpu", torch.float32).contiguous())
        h = hashlib.blake2b(digest_size=12)
        h.update(struct.pack("<IIId", layers, self.kv_heads, self.head_dim, self.attention_scaling))
        for t in (self.basis, self.sigma, self.inv_freq):
            h.update(tensor_bytes(t))
        object.__setattr__(self, "digest", h.hexdigest())

    @property
    def layers(self) -> int:
        return int(self.basis.shape[0])

    @property
    def width(self) -> int:
        return 2 * self.kv_heads * self.head_dim


_BOUND: dict[str, XQuantTables] = {}
#: int8 x int8 -> int32 matrix product (exact): private in torch's type stubs, in use since torch 2.1
_torch_int_mm = torch._int_mm  # pyright: ignore[reportPrivateImportUsage]


class CrossLayerCoding(Protocol):
    """What ``xquant`` with ``cross_layer=True`` hands over to ``compress.xquant_cl``, which registers itself on
    import (``register_cross_layer``; ``kvshelf.compress`` imports both), so neither module imports the other."""

    def layer_digest(self, digest: str) -> str:
        """The per-layer tables' digest inside the cross-layer tables bound under ``digest``
        (``XQuantUnboundError`` when none are)."""
        ...

    def layer_digest_and_depth(self, digest: str) -> tuple[str, int] | None:
        """``(per-layer digest, prediction depth)`` of the tables bound under ``digest``; None when none are."""
        ...

    def encode(self, codec: XQuantCodec, keys: torch.Tensor, values: torch.Tensor,
               start_pos: int) -> list[bytes | memoryview]: ...

    def prepare(self, codec: XQuantCodec, payload: memoryview, shape: tuple[int, int, int, int], start_pos: int, *,
                verified: bool = False) -> PreparedPayload: ...


_CROSS_LAYER: list[CrossLayerCoding] = []


def register_cross_layer(coding: CrossLayerCoding) -> None:
    """Install the cross-layer variant (called once, by ``compress.xquant_cl`` on import)."""
    _CROSS_LAYER[:] = [coding]


def _cross_layer() -> CrossLayerCoding:
    if not _CROSS_LAYER:
        raise CodecParamError("xquant: cross_layer=True needs kvshelf.compress.xquant_cl, which is not imported "
                              "(import kvshelf.compress, which registers every codec)")
    return _CROSS_LAYER[0]


def bind_tables(tables: XQuantTables) -> str:
    """Make ``tables`` available to ``xquant`` codecs in this process; return their digest (the ``model`` param)."""
    _BOUND[tables.digest] = tables
    xquant_kernels.warm_up(tables.kv_heads, tables.head_dim)
    return tables.digest


def unbind_tables(digest: str) -> None:
    """Forget the tables bound under ``digest`` (blocks using them then fail to decode with a clear error)."""
    _BOUND.pop(digest, None)
    with _PLANS_LOCK:
        _PLANS.clear()
        for key in [k for k in _KEPT_PLANS if k[0] == digest]:
            del _KEPT_PLANS[key]
    _cos_sin.cache_clear()


def bound_tables(digest: str) -> XQuantTables:
    """The tables bound under ``digest``; ``XQuantUnboundError`` when there are none."""
    tables = _BOUND.get(digest)
    if tables is None:
        raise XQuantUnboundError(
            f"xquant block needs the model tables {digest or '(none given)'!r}, which are not bound in this "
            "process: build the codec parameters with adapters.xquant.xquant_params(model) (or load_tables) first")
    return tables


def save_tables(tables: XQuantTables, path: str) -> None:
    """Write ``tables`` to a safetensors file (no pickle)."""
    from safetensors.torch import save_file

    meta = {"kv_heads": str(tables.kv_heads), "head_dim": str(tables.head_dim),
            "attention_scaling": repr(tables.attention_scaling), "digest": tables.digest}
    save_file({"basis": tables.basis, "sigma": tables.sigma, "inv_freq": tables.inv_freq}, path, metadata=meta)


def load_tables(path: str) -> XQuantTables:
    """Read tables written by ``save_tables``; ``ConfigError`` when the file is not such tables."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            tables = XQuantTables(fh.get_tensor("basis"), fh.get_tensor("sigma"), fh.get_tensor("inv_freq"),
                                  int(meta["kv_heads"]), int(meta["head_dim"]), float(meta["attention_scaling"]))
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{path}: not xquant tables: {exc}") from exc
    if meta.get("digest") != tables.digest:
        raise ConfigError(f"{path}: xquant tables digest {tables.digest} differs from the stored {meta.get('digest')}")
    return tables


# RoPE. kvshelf's RoPE is ``reuse.rope``, which ``compress`` may not import (``reuse`` sits above it), and the
# fused decode kernel (``xquant_kernels.epilogue_kernel``) applies RoPE itself from ``_cos_sin``'s tables, so the
# codec keeps a private twin of ``reuse.rope``: ``_cos_sin`` (``rope_cos_sin``) and ``_rope`` (``apply_rope``; its
# inverse divides by the rounded ``cos ** 2 + sin ** 2``, ``reuse.rope.unrope`` by ``scaling ** 2``: the encoded
# bytes stay what they were). Every torch RoPE of this module goes through them; ``tests/reuse/test_rope.py``
# checks they agree with ``reuse.rope`` bit for bit (the inverse to float rounding).


@functools.lru_cache(maxsize=64)
def _cos_sin(digest: str, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, 1, head_dim // 2]`` cos and sin (times HF's attention scaling) of positions
    ``start..start + tokens - 1``, float32 (``reuse.rope.rope_cos_sin``)."""
    tables = bound_tables(digest)
    freqs = torch.arange(start, start + tokens, dtype=torch.float32)[:, None] * tables.inv_freq[None]
    return (freqs.cos() * tables.attention_scaling)[:, None], (freqs.sin() * tables.attention_scaling)[:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """RoPE (HF ``rotate_half`` convention) of ``x`` ``[..., tokens, heads, head_dim]`` with ``cos`` / ``sin``
    ``[tokens, 1, head_dim // 2]`` (``reuse.rope.apply_rope``), or its inverse (the rotation by the opposite
    angle over ``cos ** 2 + sin ** 2``)."""
    a, b = x.chunk(2, dim=-1)
    if inverse:
        scale = 1.0 / (cos.square() + sin.square())
        cos, sin = cos * scale, -sin * scale
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@dataclass(frozen=True)
class _Plan:
    """Per (tables, parameters): kept components, their classes, and the folded decode matrices.

    Streams hold the kept components class by class (``rows``: flat ``layer * C + component`` indices, stream
    order), each class layer by layer. The symbols of layer ``l`` form a token-major ``[T, layer_widths[l]]``
    int8 matrix, its columns the layer's components class by class (``class_slots``), multiplied by
    ``matrix[l, :layer_widths[l]]`` ``[kept, C]``: the basis rows of those components times their steps (zero
    rows pad ``matrix`` to ``width``).
    """

    steps: torch.Tensor  # [layers, C] float32
    class_sizes: tuple[int, ...]
    rows: torch.Tensor  # [kept] int64
    class_counts: np.ndarray  # [classes, layers] int64: kept components of each class in each layer
    class_slots: np.ndarray  # [classes, layers] int64: the first slot of each class in each layer
    width: int
    layer_widths: tuple[int, ...]  # kept components per layer
    matrix: torch.Tensor  # [layers, width, C] float32
    matrix_bf16: torch.Tensor
    matrix_int8: torch.Tensor  # [layers, width, C] int8: ``matrix`` over ``matrix_scale``, rounded
    matrix_scale: torch.Tensor  # [layers, C] float32: each layer's per-column scale
    #: the decode's constants sent to a device (``_device_constants``), by (device, matmul): sent once
    on_device: dict[tuple[str, str], dict[str, torch.Tensor]] = field(default_factory=dict, compare=False,
                                                                       repr=False)

    def escape_coordinates(self, positions: np.ndarray, tokens: int) -> tuple[np.ndarray, ...]:
        """(layer, token, slot) of flat positions in a block's symbols (``XQuantPayload.rows`` order)."""
        sizes = self.class_counts.reshape(-1) * tokens  # segments (class, layer), in stream order
        starts = np.cumsum(sizes) - sizes
        segment = np.searchsorted(starts, positions, side="right") - 1
        cls, layer = np.divmod(segment, self.class_counts.shape[1])
        offset = positions - starts[segment]
        count = self.class_counts[cls, layer]
        return layer, offset // count, self.class_slots[cls, layer] + offset % count


#: plans kept for parameters read from block headers, the most recently used: a plan is ~7 x layers x C**2 bytes
#: (~31 MB on SmolLM2) and a header may name any parameters, so only a few are kept. The plans of this process's
#: own parameters (``keep_plan``, which ``adapters.xquant.xquant_params`` calls) stay apart, for good; a block
#: whose parameters have no plan yet builds one, counted in ``XQuantCodec.decode_workspace_bytes``.
PLAN_CACHE_SIZE = 4
_PlanKey = tuple[str, float, float, float]  # (tables digest, step, key_step_scale, drop_below)
_PLANS: OrderedDict[_PlanKey, _Plan] = OrderedDict()
_KEPT_PLANS: dict[_PlanKey, _Plan] = {}
_PLANS_LOCK = threading.Lock()


def _plan(digest: str, step: float, key_step_scale: float, drop_below: float) -> _Plan:
    """The plan of bound tables ``digest`` and these parameters: a kept one, else one of the ``PLAN_CACHE_SIZE``
    most recently used, else built."""
    key = (digest, step, key_step_scale, drop_below)
    with _PLANS_LOCK:
        plan = _KEPT_PLANS.get(key) or _PLANS.get(key)
        if plan is not None:
            if key in _PLANS:
                _PLANS.move_to_end(key)
            return plan
    plan = _build_plan(digest, step, key_step_scale, drop_below)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _plan_ready(key: _PlanKey) -> bool:
    """Whether the plan of ``key`` is built (a decode with these parameters builds none)."""
    with _PLANS_LOCK:
        return key in _KEPT_PLANS or key in _PLANS


def keep_plan(params: Mapping[str, Any]) -> None:
    """Build the plan of the ``xquant`` codec parameters ``params`` (tables bound) now and keep it for the
    process's life (until ``unbind_tables``): this process's own configuration, never evicted by blocks that
    name other parameters, and never counted in a block's decode cost."""
    codec = XQuantCodec(**params)
    key = codec._plan_key()
    plan = codec._plan()
    with _PLANS_LOCK:
        _KEPT_PLANS[key] = plan


def plan_build_bytes(tables: XQuantTables) -> int:
    """Peak bytes building a plan of ``tables`` takes: ~31 x layers x C**2 (the basis's key half in float64, the
    gathered basis rows, the folded float32 matrix and its int8 and bf16 copies), measured; a bound."""
    return 32 * tables.layers * tables.width**2


def _build_plan(digest: str, step: float, key_step_scale: float, drop_below: float) -> _Plan:
    tables = bound_tables(digest)
    layers, width_c = tables.layers, tables.width
    half = tables.kv_heads * tables.head_dim
    key_share = (tables.basis[:, :half, :].double() ** 2).sum(dim=1)  # [layers, C]
    steps = (step * key_step_scale**key_share).float()
    ratio = (tables.sigma / steps).reshape(-1)
    cls = torch.full(ratio.shape, -1, dtype=torch.int64)
    lower = drop_below
    for c, bound in enumerate(_CLASS_BOUNDS):
        cls[(ratio >= lower) & (ratio < bound) & (cls < 0)] = c
    classes = [torch.nonzero(cls == c).flatten() for c in range(len(_SCHEMES))]  # by layer, then component
    rows = torch.cat(classes)
    class_counts = np.stack([np.bincount((c // width_c).numpy(), minlength=layers) for c in classes])
    class_slots = np.cumsum(class_counts, axis=0) - class_counts  # a layer's slots: its classes in order
    counts = class_counts.sum(axis=0)
    width = max(int(counts.max()), 1)
    layer_of = rows // width_c
    slot = []  # a component's slot: its class's first slot in the layer + its rank within (class, layer)
    for c, k in enumerate(classes):
        layer = (k // width_c).numpy()  # sorted: classes hold their components layer by layer
        slot.append(class_slots[c][layer] + np.arange(len(k)) - np.searchsorted(layer, layer))
    slot = torch.from_numpy(np.concatenate(slot).astype(np.int64))
    matrix = torch.zeros(layers, width, width_c)
    comp = rows % width_c
    matrix[layer_of, slot] = tables.basis[layer_of, :, comp] * steps.reshape(-1)[rows][:, None]
    scale = (matrix.abs().amax(dim=1) / 127.0).clamp_min(1e-30)  # [layers, C]
    matrix_int8 = torch.round(matrix / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return _Plan(steps, tuple(len(c) for c in classes), rows, class_counts, class_slots, width,
                 tuple(int(c) for c in counts), matrix, matrix.to(torch.bfloat16), matrix_int8, scale)


def _lut(per: int, half_range: int) -> np.ndarray:
    """``[256]`` of uint8/16/32 words: the ``per`` digits packed in each byte value, as int8 symbols
    (``_ESCAPE`` for the escape digit), in a word of 1, 2 or 4 bytes (the 4th byte unused when ``per`` is 3)."""
    base = 2 * half_range + 2
    codes = np.arange(256)
    width = {1: 1, 2: 2, 3: 4, 4: 4}[per]
    out = np.zeros((256, width), dtype=np.int8)
    for j in range(per):
        digit = codes // base**j % base
        out[:, j] = np.where(digit == base - 1, _ESCAPE, digit - half_range)
    return out.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]).reshape(256)


_LUTS = tuple(_lut(per, m) for per, m in _SCHEMES)


def _pack(symbols: torch.Tensor, per: int, half_range: int) -> tuple[bytes, torch.Tensor]:
    """Flat int32 ``symbols`` packed ``per`` to a byte; returns the bytes and the escaped symbols (in order)."""
    base = 2 * half_range + 2
    out = symbols.abs() > half_range
    escaped = symbols[out]
    digits = torch.where(out, base - 1 - half_range, symbols) + half_range
    pad = (-digits.numel()) % per
    if pad:
        digits = torch.cat([digits, digits.new_full((pad,), half_range)])
    weights = base ** torch.arange(per, dtype=torch.int32)
    packed = (digits.view(-1, per) * weights).sum(dim=1).to(torch.uint8)
    return packed.numpy().tobytes(), escaped


def _unpack_into(data: bytes, out: np.ndarray, scheme: int) -> None:
    """Unpack ``len(out)`` int8 symbols (``_ESCAPE`` marks escapes) of class ``scheme`` into ``out``."""
    per, count = _SCHEMES[scheme][0], len(out)
    if len(data) != (count + per - 1) // per:
        raise CorruptBlockError(f"xquant payload: class {scheme} stream has {len(data)} bytes for {count} symbols")
    if count == 0:
        return
    words = np.take(_LUTS[scheme], np.frombuffer(data, dtype=np.uint8)).view(np.int8).reshape(len(data), -1)
    full = count // per
    out[: full * per].reshape(full, per)[:] = words[:full, :per]
    if full * per < count:
        out[full * per :] = words[full, : count - full * per]


_DIGITS = tuple(np.ascontiguousarray(lut.view(np.int8).reshape(256, -1)[:, :per])
                for lut, (per, _) in zip(_LUTS, _SCHEMES, strict=True))
_HAS_ESCAPE = tuple(np.any(d == _ESCAPE, axis=1) for d in _DIGITS)
_WORDS = tuple((d.view(np.uint8).astype(np.uint64) << (8 * np.arange(d.shape[1], dtype=np.uint64))).sum(axis=1,
               dtype=np.uint64) for d in _DIGITS)  # [256] uint64: a byte's symbols in the low bytes of a word


def _unpack_fused(streams: list[bytes], sizes: Sequence[int], tokens: int, esc_values: np.ndarray,
                  rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The class streams into ``rows`` with their escapes (numba, one pass); returns rows and the wide escapes."""
    wide, wide_values = np.empty(len(esc_values), np.int64), np.empty(len(esc_values), np.int32)
    escape, n_wide, at = 0, 0, 0
    for c, (data, size) in enumerate(zip(streams, sizes, strict=True)):
        per, count = _SCHEMES[c][0], size * tokens
        if len(data) != (count + per - 1) // per:
            raise CorruptBlockError(f"xquant payload: class {c} stream has {len(data)} bytes for {count} symbols")
        out, group = rows[at : at + count], xquant_kernels.GROUPS[per][1]
        out_words = out[: count - count % group].view(np.uint64)
        escape, n_wide = xquant_kernels.unpack_kernel(per)(
            np.frombuffer(data, np.uint8), _DIGITS[c], _HAS_ESCAPE[c], _WORDS[c], out, out_words, esc_values,
            escape, wide, wide_values, n_wide, at)
        if escape < 0:
            break
        at += count
    if escape != len(esc_values):
        raise CorruptBlockError(f"xquant payload: the escape digits do not match its {len(esc_values)} escaped "
                                "symbols")
    return rows, wide[:n_wide], wide_values[:n_wide]


def _unpack_numpy(streams: list[bytes], sizes: Sequence[int], tokens: int, esc_values: np.ndarray,
                  rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_unpack_fused`` with numpy (several passes), where numba is not available."""
    at = 0
    for c, (data, size) in enumerate(zip(streams, sizes, strict=True)):
        _unpack_into(data, rows[at : at + size * tokens], c)
        at += size * tokens
    escapes = np.flatnonzero(rows[:at] == _ESCAPE)
    if len(escapes) != len(esc_values):
        raise CorruptBlockError(f"xquant payload: the escape digits do not match its {len(esc_values)} escaped "
                                "symbols")
    fits = np.abs(esc_values) <= 127
    rows[escapes[fits]] = esc_values[fits]
    rows[escapes[~fits]] = 0
    return rows, escapes[~fits], esc_values[~fits]


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compress(data)


def _unzstd(data: memoryview, size: int, what: str) -> bytes:
    """The ``size`` bytes of a zstd frame, refused from its header when it declares another size."""
    return decompress_exact(data, size, what, NAME)


@register_codec
@dataclass
class XQuantCodec(Codec):
    """Pre-RoPE ``[K | V]`` latent (XQuant's SVD latent of ``X``), quantized and Huffman coded; see the module.

    Parameters: ``model``, the digest of bound ``XQuantTables`` (from ``adapters.xquant.xquant_params``);
    ``step`` (> 0) the latent quantization step; ``key_step_scale`` (> 0) the step factor of key components;
    ``drop_below`` (>= 0) the calibration spread, in steps, below which a component is not stored;
    ``max_sinks`` (0..64) and ``sink_ratio`` (> 1) of the fp16 sink tokens; ``cross_layer`` (XQuant-CL,
    ``compress.xquant_cl``): each layer's latent predicted from the rebuilt layers below it, only the residual
    stored (``model`` is then the digest of bound ``XQuantCLTables``; ``matmul`` is not used: the rebuild is
    float32, layer by layer). Left out of ``params()`` when False, so those blocks' headers are unchanged.
    """

    name: ClassVar[str] = NAME
    needs_model: ClassVar[bool] = True

    model: str = ""
    step: float = 0.35
    key_step_scale: float = 1.0
    drop_below: float = 0.1
    max_sinks: int = 2
    sink_ratio: float = 4.0
    matmul: str = "int8"
    cross_layer: bool = False

    def params(self) -> dict[str, Any]:
        params = super().params()
        if not self.cross_layer:
            del params["cross_layer"]
        return params

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.model, str):
            bad.append(f"model={self.model!r} (a digest string)")
        for name in ("step", "key_step_scale", "sink_ratio", "drop_below"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad.append(f"{name}={value!r} (a finite number)")
        if not bad:
            if not self.step > 0:
                bad.append(f"step={self.step!r} (> 0)")
            if not self.key_step_scale > 0:
                bad.append(f"key_step_scale={self.key_step_scale!r} (> 0)")
            if not self.drop_below >= 0:
                bad.append(f"drop_below={self.drop_below!r} (>= 0)")
            if not self.sink_ratio > 1:
                bad.append(f"sink_ratio={self.sink_ratio!r} (> 1)")
        if self.matmul not in ("bf16", "fp32", "int8"):
            bad.append(f"matmul={self.matmul!r} ('bf16', 'fp32' or 'int8')")
        if isinstance(self.max_sinks, bool) or not isinstance(self.max_sinks, int) or not 0 <= self.max_sinks <= 64:
            bad.append(f"max_sinks={self.max_sinks!r} (an integer in 0..64)")
        if not isinstance(self.cross_layer, bool):
            bad.append(f"cross_layer={self.cross_layer!r} (True or False)")
        if bad:
            raise CodecParamError(f"codec {NAME!r}: invalid parameter(s): {', '.join(bad)}")

    # ----------------------------------------------------------------------------------------------- helpers
    def _layer_digest(self) -> str:
        """The digest of the per-layer ``XQuantTables`` (``cross_layer``: those inside the bound cross-layer
        tables)."""
        if self.cross_layer:
            return _cross_layer().layer_digest(self.model)
        return self.model

    def _tables(self, shape: tuple[int, int, int, int]) -> XQuantTables:
        tables = bound_tables(self.model)
        layers, heads, _, dim = shape
        if getattr(shape, "value_head_dim", dim) != dim:
            raise CodecParamError(f"xquant holds blocks whose keys and values share a head dim; this block's are "
                                  f"{shape!r} (MLA: its latent needs its own codec)")
        if (layers, heads, dim) != (tables.layers, tables.kv_heads, tables.head_dim):
            raise CodecParamError(f"xquant tables {self.model} are for {tables.layers} layers x {tables.kv_heads} "
                                  f"kv heads x {tables.head_dim}, the block is {layers} x {heads} x {dim}")
        return tables

    def _plan_key(self) -> _PlanKey:
        return (self._layer_digest(), float(self.step), float(self.key_step_scale), float(self.drop_below))

    def _plan(self) -> _Plan:
        return _plan(*self._plan_key())

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """Per element of keys and values (``e``), whatever the payload holds: ``prepare_at`` peaks at ~18 bytes
        (the int8 rows, the class streams, and every symbol an int32 escape with its int64 + int32 place), keeps
        ~13 of them for ``write``, which adds the layers' symbol matrix, escapes beyond int8 sorted by layer
        (~60 bytes each at most), and per layer the product and the torch epilogue's temporaries (~32 x T x C
        bytes); plus the plan when the block's parameters have none built yet (``plan_build_bytes``: the bound
        model's size, not the block's), RoPE tables and the fp16 sinks. Tables not bound, or of another layout:
        the decode is refused before any allocation."""
        digest = str(params.get("model", ""))
        cross = params.get("cross_layer", False) is True
        cl_depth = 1
        if cross:
            found = _cross_layer().layer_digest_and_depth(digest)
            digest, cl_depth = found if found is not None else ("", 1)
        tables = _BOUND.get(digest)
        layers, heads, tokens, dim = shape
        if tables is None or (layers, heads, dim) != (tables.layers, tables.kv_heads, tables.head_dim):
            return 0
        e, per_layer = 2 * numel(shape), tokens * tables.width
        key = (tables.digest, float(params["step"]), float(params["key_step_scale"]), float(params["drop_below"]))
        plan = 0 if _plan_ready(key) else plan_build_bytes(tables)
        write = 13 * e + e + 60 * e + 36 * per_layer
        if cross:  # the rebuilt latents of every layer (float32), the symbols and the prediction of one layer
            write += 4 * layers * per_layer + (16 + 4 * cl_depth) * per_layer
        sinks = 2 * layers * heads * int(params["max_sinks"]) * dim * (2 + 4)
        return max(18 * e, write) + plan + sinks + 8 * tokens * dim + 8 * layers * tables.width

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        raise CodecParamError("xquant needs the block's start position: encode through kvstore.encoding.encode_block")

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise CodecParamError("xquant needs the block's start position: decode through kvstore.encoding.decode_block")

    # ------------------------------------------------------------------------------------------------ encode
    def encode_at(self, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> list[bytes | memoryview]:
        if keys.shape != values.shape or keys.dim() != 4:
            raise CodecParamError(f"xquant: keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be "
                                  "[layers, kv_heads, tokens, head_dim] of one head dim (xquant cannot hold an MLA "
                                  "block, whose keys and values differ in head dim)")
        if self.cross_layer:
            return _cross_layer().encode(self, keys, values, start_pos)
        shape = tuple(int(s) for s in keys.shape)
        tables = self._tables(shape)  # type: ignore[arg-type]
        layers, heads, tokens, dim = shape
        if tokens > 0xFFFF:
            raise CodecParamError(f"xquant blocks hold at most 65535 tokens, got {tokens}")
        plan = self._plan()
        if tokens == 0:
            return pack_sections([_HEAD.pack(_FORMAT, 0, 0, 0), *[b""] * (_SECTIONS - 1)])
        k = keys.detach().to("cpu", torch.float32).clamp(-_HALF_MAX, _HALF_MAX)
        v = values.detach().to("cpu", torch.float32).clamp(-_HALF_MAX, _HALF_MAX)
        cos, sin = _cos_sin(self.model, start_pos, tokens)
        k_pre = _rope(k.transpose(1, 2), cos, sin, inverse=True)  # [L, T, H, D]
        z = torch.cat([k_pre.reshape(layers, tokens, -1), v.transpose(1, 2).reshape(layers, tokens, -1)], dim=-1)
        latent = torch.bmm(z, tables.basis)  # [L, T, C]
        sinks = self._sinks(latent, tables)
        regular = torch.ones(tokens, dtype=torch.bool)
        regular[sinks] = False
        mean = latent[:, regular].mean(dim=1) if regular.any() else torch.zeros(layers, tables.width)
        mean = mean.clamp(-_HALF_MAX, _HALF_MAX).half()
        centred = (latent - mean.float()[:, None]) / plan.steps[:, None]
        centred[:, sinks] = 0.0
        symbols = torch.round(centred).clamp(-_SYMBOL_LIMIT, _SYMBOL_LIMIT).to(torch.int32)
        symbols = symbols.transpose(1, 2).reshape(layers * tables.width, tokens)[plan.rows]  # stream order
        streams, escaped, row = [], [], 0
        for c, size in enumerate(plan.class_sizes):  # each class layer by layer, token-major within a layer
            per_layer = symbols[row : row + size].split(plan.class_counts[c].tolist())
            packed, esc = _pack(torch.cat([part.t().reshape(-1) for part in per_layer]), *_SCHEMES[c])
            streams.append(_zstd(packed))
            escaped.append(esc)
            row += size
        esc_values = torch.cat(escaped).to(torch.int32)
        sink_kv = torch.stack([k[:, :, sinks], v[:, :, sinks]]).half()  # [2, L, H, sinks, D]
        sink_section = sinks.to(torch.int32).numpy().tobytes() + bytes(tensor_bytes(sink_kv))
        head = _HEAD.pack(_FORMAT, tokens, len(sinks), len(esc_values))
        return pack_sections([head, tensor_bytes(mean), sink_section, _zstd(bytes(tensor_bytes(esc_values))),
                              *streams])

    def _sinks(self, latent: torch.Tensor, tables: XQuantTables) -> torch.Tensor:
        """Token indices (int64, sorted) whose normalised latent energy is ``sink_ratio`` x the median or more."""
        tokens = latent.shape[1]
        if self.max_sinks == 0 or tokens < 4:
            return torch.empty(0, dtype=torch.int64)
        centre = latent.median(dim=1, keepdim=True).values
        energy = ((latent - centre) / tables.sigma.clamp_min(1e-6)[:, None]).square().mean(dim=(0, 2))  # [T]
        score = energy / energy.median().clamp_min(1e-12)
        top = torch.argsort(score, descending=True)[: self.max_sinks]
        return torch.sort(top[score[top] >= self.sink_ratio]).values

    # ------------------------------------------------------------------------------------------------ decode
    def decode_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        self.prepare_at(payload, shape, dtype, start_pos).write(keys, values)
        return keys, values

    def prepare_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, start_pos: int, *,
        verified: bool = False,
    ) -> PreparedPayload:
        """Check the payload and entropy-decode its symbols; the matrix products wait for ``write``."""
        if self.cross_layer:
            return _cross_layer().prepare(self, payload, shape, start_pos, verified=verified)
        tables = self._tables(shape)
        layers, heads, tokens, dim = shape
        plan = self._plan()
        sections = unpack_sections(payload, _SECTIONS, NAME, verified=verified)
        empty = np.empty(len(plan.rows) * tokens, dtype=np.int8)  # every symbol is written by the unpack
        no_sinks = (np.empty(0, dtype=np.int64), np.empty((2, layers, heads, 0, dim), dtype=np.float16))
        if tokens == 0:
            if any(len(sec) for sec in sections[1:]) or bytes(sections[0]) != _HEAD.pack(_FORMAT, 0, 0, 0):
                raise CorruptBlockError("xquant payload of an empty block is not empty")
            return XQuantPayload(self, shape, start_pos, empty, np.empty(0, np.int64), np.empty(0, np.int32),
                                 np.zeros((layers, tables.width), dtype=np.float32), *no_sinks)
        fmt, n_tokens, n_sinks, n_escapes = _HEAD.unpack(bytes(expect_len(sections[0], _HEAD.size, "head", NAME)))
        total = len(plan.rows) * tokens
        if fmt == 1:
            raise CorruptBlockError("xquant payload format 1 (component-major streams, written by an older kvshelf) "
                                    "is not read by this build: a miss, stored again on the next prefill")
        if fmt != _FORMAT or n_tokens != tokens or n_sinks > min(self.max_sinks, tokens) or n_escapes > total:
            raise CorruptBlockError(f"xquant payload head (format {fmt}, {n_tokens} tokens, {n_sinks} sinks, "
                                    f"{n_escapes} escapes) does not fit a block of {tokens} tokens")
        width_c = tables.width
        mean = np.frombuffer(expect_len(sections[1], layers * width_c * 2, "means", NAME), dtype=np.float16)
        mean = mean.astype(np.float32).reshape(layers, width_c)
        sink_bytes = expect_len(sections[2], 4 * n_sinks + 2 * layers * heads * n_sinks * dim * 2, "sinks", NAME)
        esc_values = np.frombuffer(_unzstd(sections[3], 4 * n_escapes, "escapes"), dtype=np.int32)
        streams = [_unzstd(sections[4 + c], -(-size * tokens // _SCHEMES[c][0]), f"class {c} stream")
                   for c, size in enumerate(plan.class_sizes)]
        # the rows, per class, per layer: [tokens, the layer's components of the class]; escaped values that fit
        # in int8 go into the rows, wider ones (zero in the rows) are added at ``write``
        unpack = _unpack_fused if xquant_kernels.AVAILABLE else _unpack_numpy
        rows, escapes, esc_values = unpack(streams, plan.class_sizes, tokens, esc_values, empty)
        where, sink_kv = no_sinks
        if n_sinks:
            where = np.frombuffer(sink_bytes[: 4 * n_sinks], dtype=np.int32).astype(np.int64)
            if where.min() < 0 or where.max() >= tokens:
                raise CorruptBlockError("xquant payload: sink token index out of range")
            sink_kv = np.frombuffer(sink_bytes[4 * n_sinks :], dtype=np.float16).reshape(2, layers, heads, n_sinks,
                                                                                         dim).copy()
        return XQuantPayload(self, shape, start_pos, rows, escapes, esc_values, mean, where, sink_kv)


class XQuantPayload(PreparedPayload):
    """An ``xquant`` block checked and entropy-decoded: ``write`` rematerializes it, one matrix product per layer.

    Held as numpy arrays: ``prepare_at`` (often on the store's decode threads) never touches torch; the
    torch work is all in ``write``, on the caller's thread.

    ``rows``: ``[kept * tokens]`` int8, the stream rows (symbols beyond int8 zeroed, their values in
    ``escape_values`` at flat ``escapes`` indices); ``mean``: ``[layers, C]`` float32 the latent's block means;
    ``sinks`` / ``sink_kv``: the fp16 sink tokens ``[2, layers, kv_heads, sinks, head_dim]``.
    """

    writes_to_device = True  # any other device: the portable path decodes there

    def __init__(self, codec: XQuantCodec, shape: tuple[int, int, int, int], start_pos: int, rows: np.ndarray,
                 escapes: np.ndarray, escape_values: np.ndarray, mean: np.ndarray, sinks: np.ndarray,
                 sink_kv: np.ndarray) -> None:
        self.codec, self.shape, self.start_pos = codec, shape, start_pos
        self.num_tokens = shape[2]
        self.rows = rows
        self.escapes, self.escape_values = escapes, escape_values
        self.mean, self.sinks, self.sink_kv = mean, sinks, sink_kv

    def write(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        self.write_run([self], keys_out, values_out)

    @classmethod
    def write_run(cls, run: Sequence[PreparedPayload], keys_out: torch.Tensor, values_out: torch.Tensor, *,
                  prefer_portable: bool = False) -> None:
        """One matrix product per layer over all tokens of the run's blocks (same codec, consecutive positions).

        A destination off the CPU (or ``prefer_portable``) takes ``write_portable``: the rematerialization runs
        with torch ops on the destination's device."""
        parts = [p for p in run if isinstance(p, XQuantPayload)]
        if parts and len(parts) == len(run) and all(q.continued_by(p) for q, p in zip(parts, parts[1:], strict=False)):
            if devices.portable(keys_out, prefer_portable):
                write_portable(parts, keys_out, values_out)
            else:
                _write_layers(parts, keys_out, values_out)
        elif devices.portable(keys_out, prefer_portable):
            start = 0
            for part in run:  # blocks that do not chain: one by one
                end = start + part.num_tokens
                keys, values = keys_out[:, :, start:end], values_out[:, :, start:end]
                if isinstance(part, XQuantPayload):
                    write_portable([part], keys, values)
                else:
                    part.write(keys, values)
                start = end
        else:
            write_each(run, keys_out, values_out)

    def continued_by(self, other: XQuantPayload) -> bool:
        """Whether ``other`` is the next block of the same sequence, coded alike (one run for ``write_run``)."""
        return (other.codec == self.codec and other.shape[:2] == self.shape[:2] and other.shape[3] == self.shape[3]
                and other.start_pos == self.start_pos + self.num_tokens)


def _write_layers(parts: list[XQuantPayload], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """Rematerialize chained blocks into ``keys_out`` / ``values_out`` ``[layers, kv_heads, tokens, head_dim]``.

    Per layer: the kept components' symbols ``S`` ``[T, kept]``, ``Z = S @ matrix`` (``[T, C]``; ``matrix``
    folds the basis and the steps: int8 with per-column scales by default, an exact int32 product), plus the
    block means rematerialized, RoPE on the key half at the tokens' positions; then the fp16 sinks. Symbols too
    wide for int8 (rare escapes) have their tokens recomputed in float32. The loops are split over threads that
    live for this call (``xquant_kernels.worker_pool``).
    """
    with xquant_kernels.worker_pool() as pool:
        _write_layers_on(parts, keys_out, values_out, pool)


def _write_layers_on(parts: list[XQuantPayload], keys_out: torch.Tensor, values_out: torch.Tensor,
                     pool: ThreadPoolExecutor) -> None:
    codec = parts[0].codec
    tables = bound_tables(codec.model)
    layers, heads, _, dim = parts[0].shape
    plan = codec._plan()
    counts = [p.num_tokens for p in parts]
    tokens = sum(counts)
    if tokens == 0:
        return
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    cos, sin = _cos_sin(codec.model, parts[0].start_pos, tokens)  # [T, 1, D/2]
    means = torch.from_numpy(np.stack([p.mean for p in parts], axis=1))  # [L, P, C]
    offsets = torch.bmm(means, tables.basis.transpose(1, 2))  # [L, P, C]: the block means rematerialized
    block_of = np.repeat(np.arange(len(parts), dtype=np.int64), counts)
    symbols = _symbol_matrices(parts, plan, tokens, starts, pool)
    wide = _wide_escapes(parts, plan, starts)
    fused = (xquant_kernels.AVAILABLE and keys_out.dtype == torch.float32 and values_out.dtype == torch.float32
             and keys_out[0].is_contiguous() and values_out[0].is_contiguous())
    epilogue = xquant_kernels.epilogue_kernel(heads, dim) if fused else None
    cos_flat, sin_flat = cos.numpy().reshape(-1), sin.numpy().reshape(-1)
    integer = codec.matmul == "int8"
    product = _scratch("product", tokens * tables.width, torch.int32 if integer else torch.float32).view(
        tokens, tables.width)
    ones = torch.ones(tables.width)
    for layer in range(layers):
        kept = plan.layer_widths[layer]
        if integer:
            _torch_int_mm(symbols[layer], plan.matrix_int8[layer, :kept], out=product)
            scale = plan.matrix_scale[layer]
        else:
            matrix = plan.matrix_bf16 if codec.matmul == "bf16" else plan.matrix
            product.copy_(torch.mm(symbols[layer].to(matrix.dtype), matrix[layer, :kept]))
            scale = ones
        if epilogue is not None:
            args = (product.numpy().reshape(-1), scale.numpy(), offsets[layer].numpy().reshape(-1), block_of,
                    cos_flat, sin_flat, keys_out[layer].numpy().reshape(-1), values_out[layer].numpy().reshape(-1))
            xquant_kernels.run_split(functools.partial(epilogue, *args), tokens, pool)
        else:
            z = torch.addcmul(offsets[layer][torch.from_numpy(block_of)], product, scale)  # [T, C] float32
            keys, values = _rotate_split(z, cos, sin, heads)
            keys_out[layer].copy_(keys.transpose(0, 1))
            values_out[layer].copy_(values.transpose(0, 1))
        if layer in wide:  # tokens with symbols beyond int8: recomputed in float32 from all their symbols
            where, slot, value = wide[layer]
            picked = torch.unique(where)
            rows = symbols[layer][picked].float()
            rows[torch.searchsorted(picked, where), slot] = value
            z = rows @ plan.matrix[layer, :kept] + offsets[layer][torch.from_numpy(block_of)[picked]]
            keys, values = _rotate_split(z, cos[picked], sin[picked], heads)
            keys_out[layer][:, picked] = keys.transpose(0, 1).to(keys_out.dtype)
            values_out[layer][:, picked] = values.transpose(0, 1).to(values_out.dtype)
    sink_where = torch.from_numpy(np.concatenate([p.sinks + s for p, s in zip(parts, starts, strict=True)]))
    if len(sink_where):  # the fp16 sink tokens, over every layer at once
        sink_kv = torch.from_numpy(np.concatenate([p.sink_kv for p in parts], axis=3))
        keys_out[:, :, sink_where] = sink_kv[0].to(keys_out.dtype)
        values_out[:, :, sink_where] = sink_kv[1].to(values_out.dtype)


def _rotate_split(z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """``z`` ``[T, C]`` (pre-RoPE keys, values) as keys rotated at the tokens' positions and values, each
    ``[T, heads, head_dim]``; ``cos`` / ``sin`` ``[T, 1, head_dim / 2]``."""
    tokens, half = z.shape[0], z.shape[1] // 2
    keys = _rope(z[:, :half].view(tokens, heads, -1), cos, sin, inverse=False)
    return keys, z[:, half:].view(tokens, heads, -1)


_SCRATCH = threading.local()
SCRATCH_MAX_BYTES = 64 << 20  # a thread keeps its decode buffers up to this size (a 4,096-token SmolLM2 prefix: ~30 MB)


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat ``[numel]`` buffer of this thread's, kept between decodes (already faulted in: fresh memory costs a
    page fault per 4 KiB or 2 MiB written); larger ones than ``SCRATCH_MAX_BYTES`` are not kept. The contents are
    whatever the last decode left: callers write every element they read. Valid until this thread's next call."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    kept = getattr(_SCRATCH, name, None)
    if kept is not None and kept.numel() >= nbytes:
        return kept[:nbytes].view(dtype)
    buffer = hugepages.empty((max(nbytes, 1),), torch.uint8, prefault=True)  # no faults left for the loops
    if nbytes <= SCRATCH_MAX_BYTES:
        setattr(_SCRATCH, name, buffer)
    return buffer[:nbytes].view(dtype)


def _symbol_matrices(parts: Sequence[XQuantPayload], plan: _Plan, tokens: int, starts: list[int],
                     pool: ThreadPoolExecutor) -> list[torch.Tensor]:
    """Each layer's symbols as a token-major int8 matrix ``[T, kept]`` (the blocks' tokens one after another)."""
    flat = _placed_symbols(parts, plan, tokens, starts, pool)
    widths = np.asarray(plan.layer_widths, dtype=np.int64)
    out_starts = (np.cumsum(widths * tokens) - widths * tokens).astype(np.int64)
    return [flat[o : o + w * tokens].view(tokens, w) for o, w in zip(out_starts.tolist(), plan.layer_widths,
                                                                      strict=True)]


def _placed_symbols(parts: Sequence[XQuantPayload], plan: _Plan, tokens: int, starts: list[int],
                    pool: ThreadPoolExecutor) -> torch.Tensor:
    """The layers' ``[T, kept]`` int8 symbol matrices one after another in one flat buffer (this thread's
    scratch)."""
    widths = np.asarray(plan.layer_widths, dtype=np.int64)
    out_starts = (np.cumsum(widths * tokens) - widths * tokens).astype(np.int64)
    flat = _scratch("symbols", int(widths.sum()) * tokens, torch.int8)  # every element is placed below
    out = flat.numpy()

    def place(first: int, last: int) -> None:
        for part, start in zip(parts[first:last], starts[first:last], strict=True):
            xquant_kernels.place_block(part.rows, plan.class_counts, plan.class_slots, widths, out_starts, start,
                                       part.num_tokens, out)

    xquant_kernels.run_split(place, len(parts), pool)
    return flat


def _wide_escapes(parts: Sequence[XQuantPayload], plan: _Plan,
                  starts: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Escaped symbols beyond int8, by layer: (token, slot, value float32), tokens counted over the run."""
    found: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for part, start in zip(parts, starts, strict=True):
        if not len(part.escapes):
            continue
        layer_of, token, slot = plan.escape_coordinates(part.escapes, part.num_tokens)
        value = part.escape_values.astype(np.float32)
        for layer in np.unique(layer_of).tolist():
            pick = layer_of == layer
            found.setdefault(layer, []).append((token[pick] + start, slot[pick], value[pick]))
    return {layer: tuple(torch.from_numpy(np.concatenate(x)) for x in zip(*items, strict=True))  # type: ignore[misc]
            for layer, items in found.items()}


# ------------------------------------------------------------------------------------------ the portable decode
#: elements of a layer chunk's ``[layers, T, C]`` product that the portable path computes at once (its float32
#: epilogue holds a few of these): 128 MB each
EPILOGUE_ELEMENTS = 1 << 25


def _ceil8(n: int) -> int:
    return -(-n // 8) * 8


def _device_constants(plan: _Plan, tables: XQuantTables, matmul: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The decode's model tables on ``device``, sent once per (plan, device, matmul) and kept on the plan: the
    folded matrix ``[layers, width, C]`` of the codec's ``matmul`` (int8 off the CPU: zero-padded to multiples of
    8 and each layer column-major, as CUDA's ``torch._int_mm`` wants; with its ``[layers, C]`` column scales)
    and the basis ``[layers, C, C]`` (the block means' rematerialization). On the CPU they are the plan's own
    tensors."""
    key = (str(device), matmul)
    with _PLANS_LOCK:
        kept = plan.on_device.get(key)
    if kept is not None:
        return kept
    if matmul == "int8":
        matrix = plan.matrix_int8
        rows, cols = matrix.shape[1], matrix.shape[2]
        if device.type == "cpu":
            on_device = matrix
        else:  # cuBLASLt's int8 product takes its right operand column-major: each layer stored transposed
            if rows % 8 or cols % 8:
                matrix = torch.nn.functional.pad(matrix, (0, _ceil8(cols) - cols, 0, _ceil8(rows) - rows))
            on_device = matrix.transpose(1, 2).contiguous().to(device).transpose(1, 2)
        constants = {"matrix": on_device, "scale": plan.matrix_scale.to(device)}
    else:
        constants = {"matrix": (plan.matrix_bf16 if matmul == "bf16" else plan.matrix).to(device)}
    constants["basis"] = tables.basis.to(device)
    with _PLANS_LOCK:
        plan.on_device.setdefault(key, constants)
    return constants


def _int_mm(symbols: torch.Tensor, matrix: torch.Tensor, kept: int, width_c: int,
            pad: bool | None = None) -> torch.Tensor:
    """``symbols [T, kept] @ matrix[:kept, :C]`` in int32 (exact). On CUDA ``torch._int_mm`` wants more than 16
    rows and multiples of 8 for the inner and outer sizes: the symbols are zero-padded to fit (``matrix`` already
    is, by ``_device_constants``), which leaves the product unchanged. ``pad``: whether those rules apply
    (default: off the CPU)."""
    tokens = symbols.shape[0]
    if pad is None:
        pad = symbols.device.type != "cpu"
    if not pad:
        return _torch_int_mm(symbols, matrix[:kept, :width_c])
    if tokens > 16 and kept % 8 == 0 and width_c % 8 == 0:
        if symbols.data_ptr() % 16:  # cuBLASLt wants its operands 16-byte aligned
            symbols = symbols.clone()
        return _torch_int_mm(symbols, matrix[:kept, :width_c])
    padded = symbols.new_zeros(max(tokens, 17), _ceil8(kept))
    padded[:tokens, :kept] = symbols
    return _torch_int_mm(padded, matrix[: _ceil8(kept)])[:tokens, :width_c]


def write_portable(parts: Sequence[XQuantPayload], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """Rematerialize chained ``xquant`` blocks with torch ops on the device of ``keys_out`` / ``values_out``
    (``[layers, kv_heads, tokens, head_dim]``, views of a larger cache allowed, any floating dtype).

    XQuant's premise (Tomar et al., 2025: rematerializing the KV cache from a compact latent costs compute, which
    an accelerator has, instead of memory traffic): only the compact payload goes to the device
    (``compress.device.upload``: each layer's int8 symbol matrix ``[T, kept]``, the block means ``[layers,
    blocks, C]``, the fp16 sinks, RoPE's cos / sin ``[T, head_dim / 2]`` and the rare tokens with symbols beyond
    int8), the model tables once per device (``_device_constants``). Per layer: ``Z = S @ matrix`` (int8
    ``torch._int_mm``, exact in int32, or the codec's bf16 / fp32 product), column scales, the block means
    rematerialized, RoPE on the key half, the values as they are; then the sinks. The same operations as the
    CPU path without numba (``_write_layers_on``'s torch epilogue), so on the CPU the same tensors.
    """
    codec = parts[0].codec
    tables = bound_tables(codec.model)
    layers, heads, _, dim = parts[0].shape
    plan = codec._plan()
    counts = [p.num_tokens for p in parts]
    tokens = sum(counts)
    if tokens == 0:
        return
    device = keys_out.device
    width_c = tables.width
    constants = _device_constants(plan, tables, codec.matmul, device)
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    cos, sin = _cos_sin(codec.model, parts[0].start_pos, tokens)  # [T, 1, D/2]
    block_of = np.repeat(np.arange(len(parts), dtype=np.int64), counts)
    with xquant_kernels.worker_pool() as pool:
        flat = _placed_symbols(parts, plan, tokens, starts, pool)  # host: the layers' [T, kept] one after another
    widths = [tokens * kept for kept in plan.layer_widths]
    layer_at = np.cumsum([0, *widths]).tolist()
    wide_z = _wide_products(flat, _wide_escapes(parts, plan, starts), plan, tokens, layer_at)
    sink_where = np.concatenate([p.sinks + s for p, s in zip(parts, starts, strict=True)])
    sink_kv = np.concatenate([p.sink_kv for p in parts], axis=3)  # [2, L, H, sinks, D] fp16
    small: list[object] = [np.stack([p.mean for p in parts], axis=1), cos, sin, block_of, sink_where, sink_kv]
    for picked, z in wide_z.values():
        small += [picked, z]
    sent = devices.upload(small, device, slot=2)
    means = devices.typed(sent[0], torch.float32, (layers, len(parts), width_c))
    cos, sin = (devices.typed(t, torch.float32, (tokens, 1, dim // 2)) for t in sent[1:3])
    block_of_d = devices.typed(sent[3], torch.int64, (tokens,))
    sink_where_d = devices.typed(sent[4], torch.int64, (len(sink_where),))
    sink_kv_d = devices.typed(sent[5], torch.float16, sink_kv.shape)
    wide_d = {layer: (devices.typed(sent[6 + 2 * i], torch.int64, (len(picked),)),
                      devices.typed(sent[7 + 2 * i], torch.float32, tuple(z.shape)))
              for i, (layer, (picked, z)) in enumerate(wide_z.items())}
    offsets = torch.bmm(means, constants["basis"].transpose(1, 2))  # [L, P, C]: the block means rematerialized
    slot, first = 0, 0
    for last in _layer_chunks(plan, tokens, width_c):
        (chunk,) = devices.upload([flat[layer_at[first] : layer_at[last]]], device, slot)
        slot ^= 1
        product = _layer_products(chunk.view(torch.int8), plan, range(first, last), layer_at, tokens, width_c,
                                  constants, codec.matmul)  # [chunk layers, T, C]
        if codec.matmul == "int8":
            z = torch.addcmul(offsets[first:last][:, block_of_d], product, constants["scale"][first:last, None])
        else:
            z = offsets[first:last][:, block_of_d] + product
        keys, values = _rotate_split_layers(z, cos, sin, heads)  # [chunk layers, T, H, D]
        keys_out[first:last].copy_(keys.transpose(1, 2))
        values_out[first:last].copy_(values.transpose(1, 2))
        for layer in range(first, last):
            if layer in wide_d:  # tokens with symbols beyond int8: their float32 products
                picked, zw = wide_d[layer]
                keys, values = _rotate_split(zw + offsets[layer][block_of_d[picked]], cos[picked], sin[picked], heads)
                keys_out[layer][:, picked] = keys.transpose(0, 1).to(keys_out.dtype)
                values_out[layer][:, picked] = values.transpose(0, 1).to(values_out.dtype)
        first = last
    if len(sink_where):  # the fp16 sink tokens, over every layer at once
        keys_out[:, :, sink_where_d] = sink_kv_d[0].to(keys_out.dtype)
        values_out[:, :, sink_where_d] = sink_kv_d[1].to(values_out.dtype)


def _wide_products(flat: torch.Tensor, wide: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], plan: _Plan,
                   tokens: int, layer_at: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer with symbols beyond int8 (``wide``: their ``(token, slot, value)``): ``(the tokens [k] sorted,
    their latent products [k, C] float32)``, computed on the host from ``flat`` (the layers' ``[T, kept]``
    symbols one after another) with the escaped values put back."""
    out = {}
    for layer, (where, slot, value) in wide.items():
        kept = plan.layer_widths[layer]
        picked = torch.unique(where)
        rows = flat[layer_at[layer] : layer_at[layer + 1]].view(tokens, kept)[picked].float()
        rows[torch.searchsorted(picked, where), slot] = value
        out[layer] = (picked, rows @ plan.matrix[layer, :kept])
    return out


def _layer_products(chunk: torch.Tensor, plan: _Plan, layers: range, layer_at: list[int], tokens: int, width_c: int,
                    constants: dict[str, torch.Tensor], matmul: str) -> torch.Tensor:
    """``S @ matrix`` of each of ``layers``, whose int8 symbols ``[T, kept]`` lie one after another in ``chunk``
    (on the device): ``[len(layers), T, C]``, int32 for ``matmul="int8"`` (exact), else float32. A layer whose
    components were all dropped gives zeros (its means alone)."""
    products = []
    base = layer_at[layers.start]
    for layer in layers:
        kept = plan.layer_widths[layer]
        s = chunk[layer_at[layer] - base : layer_at[layer + 1] - base].view(tokens, kept)
        if kept == 0:
            products.append(torch.zeros(tokens, width_c, device=chunk.device,
                                        dtype=torch.int32 if matmul == "int8" else torch.float32))
        elif matmul == "int8":
            products.append(_int_mm(s, constants["matrix"][layer], kept, width_c))
        else:
            matrix = constants["matrix"]
            products.append(torch.mm(s.to(matrix.dtype), matrix[layer, :kept]).float())
    return torch.stack(products)


def _rotate_split_layers(z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         heads: int) -> tuple[torch.Tensor, ...]:
    """``_rotate_split`` of several layers: ``z`` ``[layers, T, C]`` to keys (rotated) and values, each
    ``[layers, T, heads, head_dim]``."""
    half = z.shape[-1] // 2
    keys = _rope(z[..., :half].unflatten(-1, (heads, -1)), cos, sin, inverse=False)
    return keys, z[..., half:].unflatten(-1, (heads, -1))


def _layer_chunks(plan: _Plan, tokens: int, width_c: int) -> list[int]:
    """Ends of consecutive layer ranges whose symbols fit ``device.STAGING_BYTES`` and whose products fit
    ``EPILOGUE_ELEMENTS`` (one layer at least)."""
    ends, size, n = [], 0, 0
    for layer, kept in enumerate(plan.layer_widths):
        nbytes = tokens * kept
        if n and (size + nbytes > devices.STAGING_BYTES or (n + 1) * tokens * width_c > EPILOGUE_ELEMENTS):
            ends.append(layer)
            size, n = 0, 0
        size += nbytes
        n += 1
    ends.append(len(plan.layer_widths))
    return ends
