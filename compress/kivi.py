"""``int8`` / ``int4`` / ``int2``: KIVI-style asymmetric integer quantization of the KV cache.

After KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024): keys are
quantized **per channel** (each ``(layer, head, dim)`` channel over groups of ``group_size`` consecutive tokens,
because key outliers live in fixed channels) and values **per token** (each ``(layer, token)`` over groups of
``group_size`` of its ``heads * head_dim`` channels). Each group stores its minimum ``z`` and step
``s = (max - z) / (2**bits - 1)`` in fp16 (``s`` rounded up so the maximum is representable); a value ``x`` is
stored as ``q = round((x - z) / s)`` in ``bits`` bits, bit-packed; decoding is ``z + q * s``.
(KIVI's full-precision residual of recent tokens is a serving-time choice, not a storage format: kvshelf stores
whole blocks.)

Error bound, per element of a group with fp16 minimum ``z`` and step ``s``:
``|x_hat - x| <= s / 2 + 2**-11 * |min(group)|`` (plus the rounding of the output dtype).

Payload: ``bits`` bits per value plus 32 bits of fp16 ``(z, s)`` per group, in a ``container`` frame:
``int8`` with ``group_size=128`` is ~8.3 bits per value (1.93x smaller than fp16).

Decode runs where the destination lives: into CPU tensors with the host path (``KiviPayload.write``), into a
GPU's (any device but the CPU) with ``write_portable``: only the packed codes and fp16 side information go to
the device, unpacked and dequantized there with torch ops, bit for bit the host path's values. Tests run the
portable path on the CPU (``write_run(..., prefer_portable=True)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvshelf.compress.bitpack import half_bytes, half_from, pack_bits, packed_len, unpack_bits
from kvshelf.compress.container import frame_bytes, pack_sections, unpack_sections
from kvshelf.compress.device import STAGING_BYTES, portable, typed, upload
from kvshelf.compress.device import unpack_bits as device_unpack_bits
from kvshelf.kvstore.codec import (
    Codec,
    PreparedPayload,
    block_numel,
    key_shape,
    register_codec,
    value_head_dim,
    value_shape,
    write_each,
)
from kvshelf.kvstore.errors import CorruptBlockError
from kvshelf.kvstore.limits import MAX_GROUP_SIZE

_HALF_MAX = 65504.0


def quantize_groups(x: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize rows of ``x`` ``[rows, n]`` in groups of ``group_size`` along ``n``.

    Returns ``(codes [rows, n] uint8, zero [rows, groups] fp16, scale [rows, groups] fp16)``.
    """
    rows, n = x.shape
    group_size = min(group_size, max(n, 1))  # a group wider than a row is the row (no padding to its width)
    groups = (n + group_size - 1) // group_size
    x = x.float().clamp(-_HALF_MAX, _HALF_MAX)
    pad = groups * group_size - n
    padded = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1) if pad else x  # repeats: min/max unchanged
    grouped = padded.view(rows, groups, group_size)
    zero = grouped.amin(dim=2).half()
    z = zero.float()
    levels = (1 << bits) - 1
    step = (grouped.amax(dim=2) - z).clamp_min(0) / levels
    scale = step.half()
    scale = torch.where(scale.float() < step, (step * (1 + 2**-10)).half(), scale)  # round the step up
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = ((grouped - z.unsqueeze(2)) * inv.unsqueeze(2)).round_().clamp_(0, levels)
    return q.view(rows, -1)[:, :n].to(torch.uint8), zero, scale


def dequantize_groups(
    codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize_groups``: ``codes [rows, n]`` with ``zero``/``scale [rows, groups]`` (float32)."""
    rows, n = codes.shape
    group_size = min(group_size, max(n, 1))
    groups = zero.shape[1]
    pad = groups * group_size - n
    c = codes.to(torch.float32)
    if pad:
        c = torch.cat([c, c.new_zeros(rows, pad)], dim=1)
    out = torch.addcmul(zero.unsqueeze(2), c.view(rows, groups, group_size), scale.unsqueeze(2))
    return out.view(rows, -1)[:, :n].to(dtype)


class KiviCodec(Codec):
    """Base of ``int8``/``int4``/``int2``; ``bits`` is fixed by the registered name, ``group_size`` is a parameter.

    Keys and values are ``[layers, kv_heads, tokens, head_dim]``.
    """

    bits: ClassVar[int]
    group_size: int

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or not (
            1 <= self.group_size <= MAX_GROUP_SIZE
        ):
            raise ValueError(f"group_size must be an integer in [1, {MAX_GROUP_SIZE}], got {self.group_size!r}")

    @staticmethod
    def _halves(shape: tuple[int, int, int, int], group_size: int) -> list[tuple[int, int, int, int]]:
        """``(rows, cols, group, groups)`` of the keys (rows: layer, head, channel) and the values (rows: layer,
        token) of a block of ``shape``; ``group`` is ``group_size`` capped at ``cols`` (a wider one is the row)."""
        layers, heads, tokens, dim = key_shape(shape)
        vdim = value_head_dim(shape)  # MLA: the values' head dim may differ
        out = []
        for rows, cols in ((layers * heads * dim, tokens), (layers * tokens, heads * vdim)):
            g = min(group_size, max(cols, 1))
            out.append((rows, cols, g, -(-cols // g)))
        return out

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """What ``prepare_at`` keeps (the unpacked codes, one byte each below 8 bits, and a float32 zero point and
        scale per group) plus the larger half's ``write`` in the worst case, a destination the groups cannot view:
        the codes as float32, their padded copy (a partial last group), the dequantized float32 groups, and a cast
        to the destination's dtype (``itemsize``: the block's; a float32 destination needs none)."""
        if block_numel(shape) == 0:
            return 0
        halves = cls._halves(shape, int(params["group_size"]))
        kept = sum((rows * cols if cls.bits < 8 else 0) + 8 * rows * groups for rows, cols, _, groups in halves)
        write = 0
        for rows, cols, g, groups in halves:
            n, padded = rows * cols, rows * groups * g
            write = max(write, 4 * n + 4 * padded * (2 if padded > n else 1) + (itemsize * n if itemsize != 4 else 0))
        return kept + write

    @classmethod
    def payload_bounds(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int
    ) -> tuple[int, int | None] | None:
        """Exact: packed codes plus an fp16 zero point and scale per group, for keys and values."""
        g = params.get("group_size", getattr(cls, "group_size", None))  # a dataclass field's default
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            return None
        layers, heads, tokens, dim = key_shape(shape)
        vdim = value_head_dim(shape)
        n = frame_bytes(6)
        if block_numel(shape):
            for rows, cols in ((layers * heads * dim, tokens), (layers * tokens, heads * vdim)):
                n += packed_len(rows * cols, cls.bits) + 2 * 2 * rows * (-(-cols // g))
        return n, n

    @staticmethod
    def _key_rows(keys: torch.Tensor) -> torch.Tensor:
        layers, heads, tokens, dim = keys.shape
        return keys.permute(0, 1, 3, 2).reshape(layers * heads * dim, tokens)  # per channel, along tokens

    @staticmethod
    def _value_rows(values: torch.Tensor) -> torch.Tensor:
        layers, heads, tokens, dim = values.shape
        return values.permute(0, 2, 1, 3).reshape(layers * tokens, heads * dim)  # per token, along channels

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        sections: list[bytes | memoryview] = []
        for rows in (self._key_rows(keys.detach().cpu()), self._value_rows(values.detach().cpu())):
            if rows.numel() == 0:
                sections += [b"", b"", b""]
                continue
            codes, zero, scale = quantize_groups(rows, self.group_size, self.bits)
            sections += [pack_bits(codes, self.bits), half_bytes(zero), half_bytes(scale)]
        return pack_sections(sections)

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = torch.empty(key_shape(shape), dtype=dtype), torch.empty(value_shape(shape), dtype=dtype)
        self.prepare_at(payload, shape, dtype, 0).write(keys, values)
        return keys, values

    def prepare_at(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, start_pos: int, *,
        verified: bool = False,
    ) -> KiviPayload:
        """Check the payload's sections; ``write`` dequantizes them into the destination.

        The codes are unpacked here, on the caller's (often a store's decode) thread, where no GPU is present;
        where CUDA is, they are unpacked when a CPU destination needs them (``eager_host_unpack``): a GPU
        destination takes the packed codes to the device (``write_portable``)."""
        parts = unpack_sections(payload, 6, self.name, verified=verified)
        if block_numel(shape) == 0:
            if any(len(p) for p in parts):
                raise CorruptBlockError(f"{self.name} payload has data for an empty block")
            return KiviPayload(self, shape, [])
        sections = []
        for n, (rows, cols, _, groups) in enumerate(self._halves(shape, self.group_size)):
            packed, zero_buf, scale_buf = parts[3 * n : 3 * n + 3]
            if len(packed) != packed_len(rows * cols, self.bits):
                raise CorruptBlockError(f"{self.name} payload: codes are {len(packed)} bytes for {shape!r}")
            for buf, what in ((zero_buf, "zero points"), (scale_buf, "scales")):
                if len(buf) != 2 * rows * groups:
                    raise CorruptBlockError(f"{self.name} payload: {what} is {len(buf)} bytes, expected "
                                            f"{2 * rows * groups}")
            sections.append((packed, zero_buf, scale_buf))
        prepared = KiviPayload(self, shape, sections)
        if eager_host_unpack():
            prepared.host_halves()
        return prepared


def eager_host_unpack() -> bool:
    """Whether ``prepare_at`` unpacks the codes for a CPU ``write`` at once: where no CUDA is available (every
    destination is then on the CPU)."""
    return not torch.cuda.is_available()


class KiviPayload(PreparedPayload):
    """A KIVI block checked: for the keys (rows: layer, head, channel) then the values (rows: layer, token), the
    packed codes ``[rows * cols]`` (``bits`` each) and fp16 zero points and scales ``[rows, groups]``, as views of
    the payload (``sections``); ``host_halves`` unpacks them for a CPU ``write`` (uint8 codes ``[rows, cols]``,
    float32 zero points and scales)."""

    writes_to_device = True  # any other device: the portable path decodes there

    def __init__(self, codec: KiviCodec, shape: tuple[int, int, int, int],
                 sections: list[tuple[memoryview, memoryview, memoryview]]) -> None:
        self.codec, self.shape, self.sections = codec, shape, sections
        self.num_tokens = shape[2]
        self._host: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def host_halves(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The codes unpacked on the CPU: ``(codes [rows, cols] uint8, zero, scale [rows, groups] float32)`` of
        the keys and the values (computed once)."""
        if self._host is None:
            halves = []
            for (packed, zero_buf, scale_buf), (rows, cols, _, groups) in zip(
                    self.sections, KiviCodec._halves(self.shape, self.codec.group_size), strict=True):
                codes = unpack_bits(packed, rows * cols, self.codec.bits).view(rows, cols)
                zero = half_from(zero_buf, (rows, groups), "zero points", self.codec.name)
                scale = half_from(scale_buf, (rows, groups), "scales", self.codec.name)
                halves.append((codes, zero, scale))
            self._host = halves
        return self._host

    @property
    def halves(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.host_halves()

    def write(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Dequantize into ``keys_out`` / ``values_out`` (``[layers, kv_heads, tokens, head_dim]``, views of a
        cache allowed); a destination off the CPU takes the portable path (``write_portable``)."""
        if portable(keys_out):
            write_portable([self], keys_out, values_out)
            return
        if not self.sections:
            return
        layers, heads, tokens, dim = key_shape(self.shape)
        vdim = value_head_dim(self.shape)
        for n, ((codes, zero, scale), (_, _, g, _)) in enumerate(zip(self.host_halves(), KiviCodec._halves(
                self.shape, self.codec.group_size), strict=True)):
            out = keys_out if n == 0 else values_out
            direct = _group_view(out, n, g) if out.dtype == torch.float32 else None
            if direct is None:  # groups the layout cannot hold as a view: dequantize, then one transposing copy
                rows_out = dequantize_groups(codes, zero, scale, g, out.dtype)
                out.copy_(rows_out.view(layers, heads, dim, tokens).permute(0, 1, 3, 2) if n == 0
                          else rows_out.view(layers, tokens, heads, vdim).permute(0, 2, 1, 3))
                continue
            grid, side = direct  # dequantize straight into the destination layout
            torch.addcmul(zero.view(side), codes.view(grid.shape), scale.view(side), out=grid)

    @classmethod
    def write_run(cls, run: Sequence[PreparedPayload], keys_out: torch.Tensor, values_out: torch.Tensor, *,
                  prefer_portable: bool = False) -> None:
        """Write consecutive blocks (tokens along dim 2); off the CPU, or with ``prefer_portable``, through
        ``write_portable`` (blocks of one shape and codec dequantized together, one copy to the device)."""
        if portable(keys_out, prefer_portable) and all(isinstance(p, KiviPayload) for p in run):
            write_portable(run, keys_out, values_out)  # type: ignore[arg-type]
        else:
            write_each(run, keys_out, values_out)


def write_portable(run: Sequence[KiviPayload], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """Dequantize consecutive KIVI blocks with torch ops on the device of ``keys_out`` / ``values_out``
    (``[layers, kv_heads, tokens, head_dim]`` each, the values' head dim may differ (MLA); strided views of a
    larger cache allowed; any floating dtype), the blocks' tokens one after another along dim 2.

    KIVI's decode (Liu et al., ICML 2024) is ``z + q * s`` per group: only the compact payload goes to the device
    (``compress.device.upload``: the packed ``bits``-bit codes and the fp16 zero points and scales, one copy per
    batch from a page-locked buffer where CUDA is present), the codes are unpacked there with shifts and masks,
    and each group is dequantized in float32 straight into the destination's view (one rounding to its dtype):
    the same values as the CPU path's ``write``. Consecutive blocks of one codec and token count form a batch
    (``[blocks, ...]`` views of the destination), cut at ``device.STAGING_BYTES`` of payload.
    """
    start, slot = 0, 0
    for batch in _batches(run):
        count = len(batch) * batch[0].num_tokens
        if batch[0].sections:
            _dequantize_batch(batch, keys_out[:, :, start : start + count], values_out[:, :, start : start + count],
                              slot)
            slot ^= 1
        start += count


def _batches(run: Sequence[KiviPayload]) -> list[list[KiviPayload]]:
    """Consecutive blocks of one codec and shape, at most ``device.STAGING_BYTES`` of payload each (one block
    at least)."""
    batches: list[list[KiviPayload]] = []
    size = 0
    for part in run:
        nbytes = sum(len(b) for section in part.sections for b in section)
        last = batches[-1] if batches else None
        if (last is not None and last[0].codec == part.codec and last[0].shape == part.shape
                and value_head_dim(last[0].shape) == value_head_dim(part.shape) and size + nbytes <= STAGING_BYTES):
            last.append(part)
            size += nbytes
        else:
            batches.append([part])
            size = nbytes
    return batches


def _dequantize_batch(batch: list[KiviPayload], keys_out: torch.Tensor, values_out: torch.Tensor, slot: int) -> None:
    """``write_portable`` of blocks of one codec and shape: ``keys_out`` / ``values_out`` hold their tokens."""
    first = batch[0]
    codec, blocks = first.codec, len(batch)
    layers, heads, tokens, dim = key_shape(first.shape)
    vdim = value_head_dim(first.shape)
    sent = upload([[part.sections[n][i] for part in batch] for n in range(2) for i in range(3)], keys_out.device,
                  slot)
    for n, (rows, cols, g, groups) in enumerate(KiviCodec._halves(first.shape, codec.group_size)):
        packed, zero, scale = sent[3 * n : 3 * n + 3]
        codes = device_unpack_bits(packed.view(blocks, -1), rows * cols, codec.bits)  # [blocks, rows * cols]
        zero = typed(zero, torch.float16, (blocks, rows, groups)).float()
        scale = typed(scale, torch.float16, (blocks, rows, groups)).float()
        if n == 0:  # keys: per channel [blocks, layers, heads, dim] over tokens, as a view of the destination
            out = keys_out.unflatten(2, (blocks, tokens)).permute(2, 0, 1, 4, 3)
            lead: tuple[int, ...] = (blocks, layers, heads, dim)
        else:  # values: per token [blocks, layers, tokens] over heads * head_dim
            out = values_out.unflatten(2, (blocks, tokens)).permute(2, 0, 3, 1, 4)  # [B, L, T, H, Dv]
            lead = (blocks, layers, tokens)
        codes, zero, scale = codes.view(*lead, cols), zero.view(*lead, groups), scale.view(*lead, groups)
        if n == 1 and vdim % g == 0:  # groups within a head
            _dequantize_grouped(codes.view(*lead, heads, vdim), zero.view(*lead, heads, vdim // g),
                                scale.view(*lead, heads, vdim // g), g, out)
        elif n == 1 and g % vdim == 0 and heads % (g // vdim) == 0:  # groups of whole heads
            m = g // vdim
            torch.addcmul(zero.view(*lead, heads // m, 1, 1), codes.view(*lead, heads // m, m, vdim),
                          scale.view(*lead, heads // m, 1, 1), out=out.unflatten(3, (heads // m, m)))
        elif n == 1:  # groups across heads, not whole ones: dequantized in the destination dtype, then placed
            flat = torch.empty(*lead, cols, dtype=out.dtype, device=out.device)
            _dequantize_grouped(codes, zero, scale, g, flat)
            out.copy_(flat.view(*lead, heads, vdim))
        else:
            _dequantize_grouped(codes, zero, scale, g, out)


def _dequantize_grouped(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g: int,
                        out: torch.Tensor) -> None:
    """``out = zero + codes * scale`` in float32 (one rounding to ``out``'s dtype), groups of ``g`` along the last
    axis: ``codes`` / ``out`` ``[..., n]``, ``zero`` / ``scale`` ``[..., ceil(n / g)]``; a partial last group
    on its own."""
    n = codes.shape[-1]
    full = n // g
    if full:
        torch.addcmul(zero[..., :full, None], codes[..., : full * g].unflatten(-1, (full, g)),
                      scale[..., :full, None], out=out[..., : full * g].unflatten(-1, (full, g)))
    if full * g < n:
        torch.addcmul(zero[..., full:], codes[..., full * g :], scale[..., full:], out=out[..., full * g :])

def _group_view(out: torch.Tensor, n: int, g: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """For keys (``n = 0``) or values (``n = 1``): a view of ``out`` ``[layers, kv_heads, tokens, head_dim]`` with
    the quantization groups as its last axis, and the shape that broadcasts one zero/scale per group over it;
    ``None`` when the groups do not tile that layout (a partial group, or value groups that neither divide
    ``head_dim`` nor cover whole heads)."""
    layers, heads, tokens, dim = out.shape
    if n == 0:  # keys: each (layer, head, channel) over groups of g tokens
        if tokens % g:
            return None
        return out.permute(0, 1, 3, 2).unflatten(3, (tokens // g, g)), (layers, heads, dim, tokens // g, 1)
    per_token = out.permute(0, 2, 1, 3)  # values: each (layer, token) over groups of g channels
    if dim % g == 0:
        return per_token.unflatten(3, (dim // g, g)), (layers, tokens, heads, dim // g, 1)
    if g % dim == 0 and heads % (g // dim) == 0:
        m = g // dim
        return per_token.unflatten(2, (heads // m, m)), (layers, tokens, heads // m, 1, 1)
    return None


@register_codec
@dataclass
class Int8Codec(KiviCodec):
    """KIVI-style 8-bit (see the module docstring). Default groups of 128 (8.25-8.3 bits per value)."""

    name = "int8"
    bits = 8
    group_size: int = 128


@register_codec
@dataclass
class Int4Codec(KiviCodec):
    """KIVI-style 4-bit (see the module docstring). Default groups of 32, KIVI's setting (5 bits per value)."""

    name = "int4"
    bits = 4
    group_size: int = 32


@register_codec
@dataclass
class Int2Codec(KiviCodec):
    """KIVI-style 2-bit (see the module docstring). Default groups of 32, KIVI's setting (3 bits per value)."""

    name = "int2"
    bits = 2
    group_size: int = 32
