"""``cachegen``: CacheGen-style entropy coding of the KV cache.

After CacheGen (Liu et al., "CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
Serving", SIGCOMM 2024), with QuaRot's Hadamard rotation (Ashkboos et al., 2024) as an option: layer-dependent
uniform steps from each stream's spread, deltas against anchor tokens, sinks in fp16, ANS coding with compact
per-stream models. Keys and values: ``[layers, kv_heads, tokens, head_dim]``. The design and error bound:
docs/codecs.md, "How cachegen works".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import constriction
import numpy as np
import torch

from kvshelf.compress._cast import numel
from kvshelf.compress.bitpack import half_bytes, half_from, pack_bits, packed_len
from kvshelf.compress.container import expect_len, pack_sections, unpack_sections
from kvshelf.compress.hadamard import factors, is_power_of_two, rotate
from kvshelf.compress.raw import tensor_bytes, tensor_from_bytes
from kvshelf.kvstore.codec import Codec, key_shape, register_codec, value_head_dim
from kvshelf.kvstore.errors import CorruptBlockError
from kvshelf.kvstore.limits import MAX_GROUP_SIZE

#: the compiled module's submodules, which its type stubs do not list
_stream = constriction.stream  # pyright: ignore[reportAttributeAccessIssue]

_HALF_MAX = 65504.0
_MIN_STEP = 2.0**-24
_MAX_R = 16
_SYMBOL_LIMIT = 1 << 30
_ESCAPE_BITS = 24  # an escape stores a uint16 index gap and an int8 coarse part (wider ones overflow)
_SECTIONS = 16
_FORMAT_TAG = b"\x03"  # section 0: the payload format (1: channel-major; 2: int32 escapes)
_GAP_OVERFLOW = 0xFFFF  # an escape index gap this large or larger is stored as uint32 apart
_COARSE_OVERFLOW = -128  # an escape coarse part outside [-127, 127] is stored as int32 apart
_P_LEVELS = 8  # flag probabilities are rounded to 2**(k / 8), so few distinct ANS models exist
_MAX_SINKS = 8
_HIST_LIMIT = 1 << 12
_CHUNK = 1 << 18  # elements a decode's index and product temporaries cover at once (2 MiB of int64 indices)
_SYMBOLS_PEAK = 18  # bytes per element while symbols are built: flags, signs, int32 symbols, a width's planes


def _coarse_masks() -> tuple[torch.Tensor, torch.Tensor]:
    """``[widths, histogram bins]`` masks of the symbols whose coarse part is +-1 / beyond, per fine width."""
    values = torch.arange(-_HIST_LIMIT, _HIST_LIMIT + 1)
    widths = torch.arange(_MAX_R + 1)[:, None]
    coarse = ((values + ((1 << widths) >> 1)) >> widths).abs()
    return (coarse == 1).double(), (coarse >= 2).double()


_R_UNIT, _R_ESCAPE = _coarse_masks()
_FLAGS = 16  # flags per ANS symbol
_MAX_SET = 3  # set flags per word without an escape


def _word_alphabet() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(symbol of each 16-flag word, word of each symbol, popcount of each symbol)``.

    Words with at most three set flags are symbols ``0..696`` (by popcount); every other word is the escape
    symbol ``697`` and is stored as is.
    """
    words = [w for w in range(1 << _FLAGS) if bin(w).count("1") <= _MAX_SET]
    words.sort(key=lambda w: (bin(w).count("1"), w))
    to_symbol = np.full(1 << _FLAGS, len(words), dtype=np.int32)
    to_symbol[np.array(words)] = np.arange(len(words), dtype=np.int32)
    popcount = np.array([bin(w).count("1") for w in words], dtype=np.float64)
    return to_symbol, np.array(words + [0], dtype=np.uint16), popcount


_TO_SYMBOL, _TO_WORD, _SYMBOL_POPCOUNT = _word_alphabet()
_ESCAPE_WORD = len(_SYMBOL_POPCOUNT)


def _flag_table(p: float) -> np.ndarray:
    """Probabilities of the 698 symbols of 16 independent flags, each set with probability ``p``."""
    probs = p**_SYMBOL_POPCOUNT * (1.0 - p) ** (_FLAGS - _SYMBOL_POPCOUNT)
    return np.append(probs, max(1.0 - probs.sum(), 1e-9))


@functools.lru_cache(maxsize=1 << 12)
def _flag_model(p: float) -> Any:
    """The (immutable, shared) constriction ``Categorical`` of ``_flag_table(p)``; ``p`` is a stored fp16 value."""
    return _stream.model.Categorical(_flag_table(p), perfect=False)


def _symbols(x: torch.Tensor, mean: torch.Tensor, step: torch.Tensor,
             anchor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized symbols of the streams ``x`` ``[S, H, T, D]`` (int32, same shape) on the grid ``mean`` /
    ``step``, and per channel ``[S, H, D]`` whether its non-anchor tokens hold deltas from their ``anchor``
    token's reconstruction instead (CacheGen's delta coding, where it needs fewer bits: mean |symbol|, a
    Laplacian's entropy proxy, under 0.9 of the plain symbols'). ``anchor``: ``[T]`` each token's anchor; None for
    a single token."""
    streams, heads, tokens, dim = x.shape
    inv = 1.0 / step
    symbols = ((x - mean) * inv).round_().clamp_(-_SYMBOL_LIMIT, _SYMBOL_LIMIT).to(torch.int32)
    use_delta = torch.zeros(streams, heads, dim, dtype=torch.bool)
    if anchor is None:
        return symbols, use_delta
    rest = anchor != torch.arange(tokens)
    predicted = _reconstruct(mean, symbols[:, :, anchor[rest]], step)
    delta = ((x[:, :, rest] - predicted) * inv).round_().clamp_(-_SYMBOL_LIMIT, _SYMBOL_LIMIT).to(torch.int32)
    use_delta = delta.abs().sum(dim=2) < 0.9 * symbols[:, :, rest].abs().sum(dim=2)
    if bool(use_delta.any()):
        symbols[:, :, rest] = torch.where(use_delta[:, :, None, :], delta, symbols[:, :, rest])
    return symbols, use_delta


def _code_flags(nonzero: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """ANS-code each stream's nonzero flags ``[S, E]`` (bool), ``_FLAGS`` at a time, under a Bernoulli model of
    the stream's nonzero rate: ``(the rates [S] fp16 on a log grid, the compressed words "<u4", the flag words too
    rare for the joint alphabet "<u2")``."""
    streams, per_stream = nonzero.shape
    p = nonzero.float().mean(dim=1).clamp_min(2.0**-12)
    p = torch.exp2(torch.round(torch.log2(p) * _P_LEVELS) / _P_LEVELS)  # a log grid: cached models
    p = p.clamp(2.0**-12, 1 - 2.0**-11).half()  # 1 - 2**-12 rounds to 1 in fp16
    padded = (per_stream + _FLAGS - 1) // _FLAGS * _FLAGS
    flags = np.zeros((streams, padded), dtype=np.uint8)
    flags[:, :per_stream] = nonzero.numpy()
    words = np.packbits(flags, axis=1, bitorder="little").view("<u2")
    joint = _TO_SYMBOL[words]
    coder = _stream.stack.AnsCoder()
    for s in range(streams - 1, -1, -1):  # a stack: encode in reverse, decode forward
        coder.encode_reverse(joint[s], _flag_model(float(p[s])))
    return p, coder.get_compressed().astype("<u4"), words[joint == _ESCAPE_WORD]


def _binary_entropy(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-9, 1 - 1e-9)
    return -(p * torch.log2(p) + (1 - p) * torch.log2(1 - p))


def _reconstruct(mean: torch.Tensor, symbols: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``mean + symbols * step`` in float32 (shared by encoder and decoder, so predictions agree)."""
    return mean + symbols.to(torch.float32) * step


@register_codec
@dataclass
class CacheGenCodec(Codec):
    """CacheGen-style codec for keys and values ``[layers, kv_heads, tokens, head_dim]`` (see the module doc).

    Parameters: ``bits`` (1..7, fractional allowed): the step is the stream's std over ``2**(bits - 2)``;
    ``early_extra_bits`` (0..3) more in the first ``early_fraction`` (0..1) of the layers, ``key_extra_bits`` /
    ``value_extra_bits`` (0..3) more for keys / values; anchors every ``group_size`` tokens; ``rotate``: Hadamard
    rotation of ``head_dim`` (when it is a power of two); ``sink_ratio`` (0..1, 0 disables): tokens whose value
    norm is below this fraction of the median are stored in fp16 (attention sinks).
    """

    name = "cachegen"
    bits: float = 3.5
    early_extra_bits: int = 0
    early_fraction: float = 0.1
    group_size: int = 16
    rotate: bool = False
    key_extra_bits: int = 0
    value_extra_bits: int = 0
    sink_ratio: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int | float) or not 1 <= self.bits <= 7:
            raise ValueError(f"bits must be a number in [1, 7], got {self.bits!r}")
        for field_name, low, high in (("early_extra_bits", 0, 3), ("group_size", 2, MAX_GROUP_SIZE),
                                       ("key_extra_bits", 0, 3), ("value_extra_bits", 0, 3)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{field_name} must be an integer in [{low}, {high}], got {value!r}")
        if self.bits + self.early_extra_bits + max(self.key_extra_bits, self.value_extra_bits) > 8:
            raise ValueError("bits + early_extra_bits + key/value_extra_bits must be <= 8")
        if isinstance(self.early_fraction, bool) or not isinstance(self.early_fraction, int | float) or not (
            0.0 <= self.early_fraction <= 1.0
        ):
            raise ValueError(f"early_fraction must be a number in [0, 1], got {self.early_fraction!r}")
        if isinstance(self.sink_ratio, bool) or not isinstance(self.sink_ratio, int | float) or not (
            0.0 <= self.sink_ratio < 1.0
        ):
            raise ValueError(f"sink_ratio must be a number in [0, 1), got {self.sink_ratio!r}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be a boolean, got {self.rotate!r}")

    @classmethod
    def decode_workspace_bytes(
        cls, params: Mapping[str, Any], shape: tuple[int, int, int, int], itemsize: int, payload_len: int
    ) -> int:
        """The peak of the decode's phases, per element of keys and values, whatever the payload holds: the
        symbols (flags, signs, and up to two widths' int32 planes: ``_SYMBOLS_PEAK`` bytes; ~15 measured on a
        crafted worst case), the float32 values with the escapes (~36 bytes each; each takes 3 payload bytes),
        the anchors (``8 / group_size``), the rotation (one or two float32 buffers beside the values: one pass, or
        a pass's input and output) with the fp16 sinks read (2 payload bytes each);
        plus per channel and per token arrays and the ANS words. ``prepare_at`` keeps the decoded tensors for
        ``write`` (the default): less than any of these phases. The chunked temporaries (3 MiB) and the flag models
        made for new probabilities (~2.7 KiB each, 5.5 MiB for ``MAX_LAYERS``; a bounded cache) are within
        ``DECODE_OVERHEAD_BYTES``."""
        layers, heads, tokens, dim = shape
        dim = max(dim, value_head_dim(shape))  # keys and values of different head dims: both padded to the wider
        padded = 2 * numel((layers, heads, tokens, dim)) * itemsize if dim != value_head_dim(shape) or dim != shape[3] \
            else 0  # the padded tensors decoded, beside the declared ones cut out of them
        elements = 2 * numel((layers, heads, tokens, dim))
        if elements == 0:
            return 0
        escapes, sink_values = min(elements, payload_len // 3), min(elements, payload_len // 2)
        rotated = bool(params.get("rotate")) and is_power_of_two(dim) and dim > 1
        rotation = 4 * min(len(factors(dim)), 2) * elements if rotated else 0
        anchors = 8 * elements // max(int(params.get("group_size", 2)), 2)
        phases = (_SYMBOLS_PEAK * elements, 8 * elements + 36 * escapes, 4 * elements + anchors,
                  4 * elements + rotation + 4 * sink_values)
        return max(phases) + 16 * 2 * layers * heads * dim + 16 * tokens + payload_len + padded

    # -- layout -----------------------------------------------------------------------------------------

    def _rotated(self, dim: int) -> bool:
        return self.rotate and is_power_of_two(dim) and dim > 1

    def _scale(self, dim: int) -> float:
        """Power of two by which means and steps are divided before their fp16 storage (rotation grows them)."""
        return float(2 ** math.ceil(math.log2(math.sqrt(dim)))) if self._rotated(dim) else 1.0

    def _stream_bits(self, layers: int) -> torch.Tensor:
        """``b`` per stream ``[2 * layers]`` (keys' layers then values')."""
        early = math.ceil(self.early_fraction * layers)
        per_layer = torch.full((layers,), float(self.bits), dtype=torch.float64)
        per_layer[:early] += self.early_extra_bits
        return torch.cat([per_layer + self.key_extra_bits, per_layer + self.value_extra_bits])

    def sink_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Sorted indices of the block's attention-sink-like tokens, stored in fp16 rather than quantized.

        Attention sinks (StreamingLLM; Xiao et al., 2024) such as a sequence's first token draw much of every
        query's attention, so their quantization error weighs most; on Llama-style models their value vectors
        are far smaller than the other tokens'. A token is a sink when its value norm, averaged over layers and
        heads, is below ``sink_ratio`` times the block's median (at most ``_MAX_SINKS``).
        """
        tokens = values.shape[2]
        if self.sink_ratio <= 0 or tokens < 2 or values.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        norms = values.detach().cpu().float().clamp(-_HALF_MAX, _HALF_MAX).norm(dim=-1).mean(dim=(0, 1))
        below = (norms < self.sink_ratio * norms.median()).nonzero().view(-1)
        if len(below) > _MAX_SINKS:
            below = below[norms[below].topk(_MAX_SINKS, largest=False).indices]
        return below.sort().values

    def _streams(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Rotated streams ``[2 * layers, kv_heads, tokens, head_dim]`` (float32, saturated to the fp16 range;
        keys' layers then values', in the block's own memory order); sink tokens are replaced by their channels'
        means (they are stored apart)."""
        layers, heads, tokens, dim = keys.shape
        x = torch.stack([keys.detach().cpu(), values.detach().cpu()]).float().clamp(-_HALF_MAX, _HALF_MAX)
        if self._rotated(dim):
            x = rotate(x)
        x = x.reshape(2 * layers, heads, tokens, dim).contiguous()
        sinks = self.sink_tokens(values)
        if len(sinks):
            keep = torch.ones(tokens, dtype=torch.bool)
            keep[sinks] = False
            x[:, :, sinks] = x[:, :, keep].mean(dim=2, keepdim=True)
        return x

    def _grid(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 ``(means [streams, heads, head_dim], steps [streams])``, both divided by ``_scale(dim)``."""
        scale = self._scale(dim)
        mean16 = (x.mean(dim=2) / scale).clamp(-_HALF_MAX, _HALF_MAX).half()
        dev = x - mean16.float()[:, :, None, :] * scale
        std = dev.pow(2).mean(dim=(1, 2, 3)).sqrt()
        step = std / (2.0 ** (self._stream_bits(x.shape[0] // 2) - 2)).float()  # bits may be fractional
        step = torch.where(std > 0, step, torch.ones_like(step) * scale) / scale
        step16 = step.clamp(_MIN_STEP, _HALF_MAX).half()
        return mean16, step16

    def steps(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The quantization step of each stream ``[2, layers]`` (keys, values), as the decoder uses it."""
        x = self._streams(keys, values)
        _, step16 = self._grid(x, keys.shape[3])
        return (step16.float() * self._scale(keys.shape[3])).view(2, -1)

    def error_bound(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The documented per-element bound of each stream ``[2, layers]`` (see the module docstring)."""
        dim = keys.shape[3]
        return self.steps(keys, values) / 2 * (math.sqrt(dim) if self._rotated(dim) else 1.0)

    def _anchor_of(self, tokens: int) -> torch.Tensor:
        return torch.arange(tokens) // self.group_size * self.group_size

    # -- encode -----------------------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        """Keys and values of different head dims (MLA) are coded as one width: the narrower zero-padded to the
        wider (its padding channels code to next to nothing), cut back to its declared dim on decode."""
        dk, dv = keys.shape[3], values.shape[3]
        if dk != dv:
            width = max(dk, dv)
            keys = torch.nn.functional.pad(keys.detach().cpu(), (0, width - dk))
            values = torch.nn.functional.pad(values.detach().cpu(), (0, width - dv))
        return self._encode_streams(keys, values)

    def _encode_streams(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        layers, heads, tokens, dim = keys.shape
        if keys.numel() == 0:
            return pack_sections([_FORMAT_TAG] + [b""] * (_SECTIONS - 1))
        x = self._streams(keys, values)  # [S, H, T, D]
        sinks = self.sink_tokens(values)
        sink_kv = torch.stack([keys.detach().cpu()[:, :, sinks], values.detach().cpu()[:, :, sinks]]).float()
        sink_kv = sink_kv.clamp(-_HALF_MAX, _HALF_MAX)
        streams = x.shape[0]
        scale = self._scale(dim)
        mean16, step16 = self._grid(x, dim)
        mean = mean16.float()[:, :, None, :] * scale
        step = step16.float()[:, None, None, None] * scale
        anchor = self._anchor_of(tokens) if tokens > 1 else None
        symbols, use_delta = _symbols(x, mean, step, anchor)
        symbols = symbols.view(streams, -1)  # [S, E]: each stream's symbols in memory order
        r = self._best_r(symbols)
        rr = r[:, None].to(torch.int32)
        half = torch.where(rr > 0, 1 << (rr - 1).clamp_min(0), 0).to(torch.int32)
        shifted = symbols + half
        coarse = shifted >> rr
        fine = shifted - (coarse << rr)
        escape = (coarse >= 2) | (coarse <= -2)
        nonzero = (coarse != 0) & ~escape

        p, compressed, escaped_words = _code_flags(nonzero)
        nonzero_np = nonzero.numpy()
        signs = np.packbits(coarse.numpy()[nonzero_np] < 0, bitorder="little")
        fine_np = fine.numpy()
        fine_parts = [_pack_planes(fine_np[(r == width).numpy()], int(width)) for width in torch.unique(r)
                      if int(width) > 0]
        esc_at = escape.view(-1).nonzero().view(-1).numpy()  # ascending flat indices
        gaps = np.diff(esc_at, prepend=0)
        esc_coarse = coarse.view(-1).numpy()[esc_at]
        wide = (esc_coarse < -127) | (esc_coarse > 127)
        return pack_sections([
            _FORMAT_TAG, tensor_bytes(r.to(torch.uint8)), pack_bits(use_delta.view(-1).to(torch.uint8), 1),
            half_bytes(mean16), half_bytes(step16), half_bytes(p), memoryview(compressed.tobytes()),
            memoryview(b"".join(fine_parts)), memoryview(signs.tobytes()),
            np.minimum(gaps, _GAP_OVERFLOW).astype("<u2").tobytes(),
            np.where(wide, _COARSE_OVERFLOW, esc_coarse).astype(np.int8).tobytes(),
            memoryview(escaped_words.astype("<u2").tobytes()),
            tensor_bytes(sinks.to(torch.int32)), half_bytes(sink_kv),
            gaps[gaps >= _GAP_OVERFLOW].astype("<u4").tobytes(), esc_coarse[wide].astype("<i4").tobytes(),
        ])

    @staticmethod
    def _best_r(symbols: torch.Tensor) -> torch.Tensor:
        """Per stream of ``symbols [streams, n]``: the fine width ``r`` of least estimated bits, from a histogram
        of each stream's symbols (beyond +-4096 they count as escapes)."""
        streams = symbols.shape[0]
        limit = _HIST_LIMIT
        idx = symbols.clamp(-limit, limit).long() + limit + (torch.arange(streams) * (2 * limit + 1))[:, None]
        hist = torch.bincount(idx.reshape(-1), minlength=streams * (2 * limit + 1)).view(streams, -1).double()
        total = hist.sum(dim=1, keepdim=True)
        n_nz, n_esc = hist @ _R_UNIT.T, hist @ _R_ESCAPE.T  # [streams, widths]
        widths = torch.arange(_MAX_R + 1, dtype=torch.float64)
        cost = total * (widths + _binary_entropy(n_nz / total)) + n_nz + _ESCAPE_BITS * n_esc
        return cost.argmin(dim=1)

    # -- decode -----------------------------------------------------------------------------------------

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = shape[3], value_head_dim(shape)
        if dk == dv:
            return self._decode_streams(payload, key_shape(shape), dtype)
        keys, values = self._decode_streams(payload, (*shape[:3], max(dk, dv)), dtype)  # see encode
        return keys[..., :dk].contiguous(), values[..., :dv].contiguous()

    def _decode_streams(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layers, heads, tokens, dim = shape
        parts = unpack_sections(payload, _SECTIONS, self.name)
        if bytes(parts[0]) != _FORMAT_TAG:
            raise CorruptBlockError(f"cachegen payload: format {bytes(parts[0])!r}, this version reads "
                                    f"{_FORMAT_TAG!r} (re-encode the block)")
        if numel(shape) == 0:
            if any(len(p) for p in parts[1:]):
                raise CorruptBlockError("cachegen payload has data for an empty block")
            return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        streams = 2 * layers
        per_stream = heads * tokens * dim
        if len(parts[1]) != streams:
            raise CorruptBlockError(f"cachegen payload: {len(parts[1])} fine widths, expected {streams}")
        r = np.frombuffer(parts[1], dtype=np.uint8).astype(np.int64)
        if bool((r > _MAX_R).any()):
            raise CorruptBlockError("cachegen payload: a fine width is out of range")
        if len(parts[2]) != packed_len(streams * heads * dim, 1):
            raise CorruptBlockError("cachegen payload: bad delta flags")
        use_delta = np.unpackbits(np.frombuffer(parts[2], dtype=np.uint8), count=streams * heads * dim,
                                  bitorder="little").view(np.bool_).reshape(streams, heads, dim)
        if tokens == 1 and bool(use_delta.any()):
            raise CorruptBlockError("cachegen payload: delta channels in a one-token block")
        mean16 = half_from(parts[3], (streams, heads, dim), "channel means", self.name)
        step16 = half_from(parts[4], (streams,), "steps", self.name)
        p = half_from(parts[5], (streams,), "flag probabilities", self.name)
        if not bool(((p > 0) & (p < 1)).all()) or not bool((step16 > 0).all()) or not bool(mean16.isfinite().all()):
            raise CorruptBlockError("cachegen payload: bad stream statistics")
        if len(parts[6]) % 4 or len(parts[9]) != 2 * len(parts[10]) or len(parts[12]) % 4 or len(parts[14]) % 4 or (
            len(parts[15]) % 4
        ):
            raise CorruptBlockError("cachegen payload: bad ANS stream, escape or sink sections")
        sinks = np.frombuffer(parts[12], dtype="<i4").astype(np.int64)
        if len(sinks) and (int(sinks[0]) < 0 or int(sinks[-1]) >= tokens or bool((np.diff(sinks) <= 0).any())):
            raise CorruptBlockError("cachegen payload: bad sink token indices")
        sink_shape = (2, layers, heads, len(sinks), dim)
        sink_bytes = expect_len(parts[13], 2 * numel(sink_shape), "sink tokens", self.name)  # read at the end

        flags, negative = self._flags(parts, p.numpy(), streams, per_stream)
        scale = np.float32(self._scale(dim))
        step = step16.numpy() * scale  # [S]
        mean = mean16.numpy() * scale  # [S, H, D]
        sym = self._symbols(flags, negative, r, parts[7])  # [S, E]: int8 / int16 / int32
        del flags, negative  # (the working arrays go as soon as they are used: see decode_workspace_bytes)
        x = np.empty((streams, heads, tokens, dim), dtype=np.float32)
        np.multiply(sym, step[:, None], out=x.reshape(streams, per_stream), casting="unsafe")  # symbol * step
        self._escapes(parts, sym, r, x.reshape(streams, per_stream), step)
        del sym
        self._add_base(x, mean, use_delta)
        out = torch.from_numpy(x).view(2, layers, heads, tokens, dim)
        if self._rotated(dim):
            out = rotate(out)  # a fast Walsh-Hadamard transform: O(head_dim) memory per vector
        if len(sinks):
            out[:, :, :, torch.from_numpy(sinks)] = tensor_from_bytes(sink_bytes, torch.float16, sink_shape,
                                                                      copy=False).float()
        if dtype != torch.float32:
            out = out.to(dtype)
        return out[0], out[1]

    def _add_base(self, x: np.ndarray, mean: np.ndarray, use_delta: np.ndarray) -> None:
        """Turn ``x = symbol * step`` ``[S, H, T, D]`` into the decoded values, in place: plus the channel mean
        ``mean [S, H, D]``, or, for the non-anchor tokens of delta channels (``use_delta [S, H, D]``), plus their
        group's decoded anchor ``mean + x[anchor]`` (each group's anchor is its first token); the same float32
        operations as the encoder's ``_reconstruct`` and prediction, so deltas build on the anchors it predicted."""
        streams, heads, tokens, dim = x.shape
        g = self.group_size
        if tokens == 1 or not use_delta.any():
            x += mean[:, :, None, :]
            return
        anchor_hat = x[:, :, ::g, :] + mean[:, :, None, :]  # [S, H, groups, D]
        base = np.where(use_delta[:, :, None, :], anchor_hat, mean[:, :, None, :])
        whole = tokens // g  # whole groups; the last, partial group (if any) has its anchor at whole * g
        if whole:
            grid = x[:, :, : whole * g].reshape(streams, heads, whole, g, dim)  # a view: one axis split
            grid += base[:, :, :whole, None, :]
        if whole * g < tokens:
            x[:, :, whole * g :] += base[:, :, whole : whole + 1, :]
        x[:, :, ::g, :] = anchor_hat

    @staticmethod
    def _symbols(flags: np.ndarray, negative: np.ndarray, r: np.ndarray, fine_buf: memoryview) -> np.ndarray:
        """The symbols ``[S, E]``, ``fine + coarse * 2**r - 2**r // 2``, from the significance flags ``[S, E]``
        (uint8, consumed), the signs of the set ones (``negative [S, E]`` bool: coarse part -1) and the fine bits
        (widths ``r [S]``); in the narrowest integer type that holds every stream's range (int8 up to ``r = 6``),
        computed in its unsigned twin (modular arithmetic). Escaped symbols are completed by ``_escapes``."""
        streams, per_stream = flags.shape
        top = int(r.max())
        dtype = np.int8 if top <= 6 else np.int16 if top <= 14 else np.int32
        unsigned = {np.int8: np.uint8, np.int16: np.uint16, np.int32: np.uint32}[dtype]
        widths = np.unique(r).tolist()
        out = None if len(widths) == 1 else np.empty((streams, per_stream), dtype=unsigned)
        pos = 0
        for width in widths:
            sel = np.flatnonzero(r == width)
            count = len(sel) * per_stream
            nbytes = _planes_len(count, width) if width else 0
            if pos + nbytes > len(fine_buf):
                raise CorruptBlockError("cachegen payload: the fine bits are truncated")
            f = flags if out is None else flags[sel]
            f = f if unsigned is np.uint8 else f.astype(unsigned)
            if width == 0:
                t = f
            else:
                t = _unpack_planes(fine_buf[pos : pos + nbytes], count, width).reshape(len(sel), per_stream)
                if t.dtype != unsigned:  # int32 planes in uint32: a view; uint8 ones in a wider type: a copy
                    t = t.view(unsigned) if t.dtype.itemsize == np.dtype(unsigned).itemsize else t.astype(unsigned)
                f *= unsigned(1 << width)  # (a multiply: numpy's uint8 shift is not vectorised)
                t += f
                t -= unsigned(1 << (width - 1))
            pos += nbytes
            if out is None:
                out = t
            else:
                out[sel] = t
        if pos != len(fine_buf):
            raise CorruptBlockError("cachegen payload: the fine bits have the wrong length")
        assert out is not None
        less = ((2 << r) & np.iinfo(unsigned).max).astype(unsigned)  # coarse -1: 2**(r + 1) less than the +1 added
        for row, signs, amount in zip(out, negative, less, strict=True):  # a stream at a time
            _subtract_where(row, signs, amount)
        return out.view(dtype)

    @staticmethod
    def _escapes(parts: list[memoryview], sym: np.ndarray, r: np.ndarray, x: np.ndarray, step: np.ndarray) -> None:
        """Write the escapes (``|coarse| >= 2``) into ``x`` ``[S, E]`` (float32, ``symbol * step``): their flat
        indices as uint16 gaps (ascending) and their int8 coarse parts, wider ones apart (uint32 / int32); their
        fine bits are in ``sym`` ``[S, E]`` (as for coarse 0). In place where it can: ~36 bytes per escape."""
        at = np.frombuffer(parts[9], dtype="<u2").astype(np.int64)  # the gaps, then (cumsum) the indices
        if not len(at):
            if len(parts[14]) or len(parts[15]):
                raise CorruptBlockError("cachegen payload: wide escape parts without escapes")
            return
        long_gap = at == _GAP_OVERFLOW
        if len(parts[14]) != 4 * int(long_gap.sum()):
            raise CorruptBlockError("cachegen payload: the wide escape gaps have the wrong length")
        at[long_gap] = np.frombuffer(parts[14], dtype="<u4")
        del long_gap
        if bool((at[1:] == 0).any()):
            raise CorruptBlockError("cachegen payload: repeated escape index")
        np.cumsum(at, out=at)
        if int(at[-1]) >= sym.size:
            raise CorruptBlockError("cachegen payload: an escape index is out of range")
        coarse8 = np.frombuffer(parts[10], dtype=np.int8)
        wide = coarse8 == _COARSE_OVERFLOW
        if len(parts[15]) != 4 * int(wide.sum()):
            raise CorruptBlockError("cachegen payload: the wide escape parts have the wrong length")
        symbol = coarse8.astype(np.int64)  # the coarse parts, then (shifted, plus the fine bits) the symbols
        symbol[wide] = np.frombuffer(parts[15], dtype="<i4")
        del wide
        if bool((np.abs(symbol) < 2).any()) or bool((np.abs(symbol) > _SYMBOL_LIMIT).any()):
            raise CorruptBlockError("cachegen payload: an escape's coarse part is out of range")
        stream = at // sym.shape[1]
        np.left_shift(symbol, r[stream], out=symbol)
        symbol += sym.reshape(-1)[at]
        if bool((np.abs(symbol) > _SYMBOL_LIMIT).any()):
            raise CorruptBlockError("cachegen payload: an escaped symbol is out of range")
        x.reshape(-1)[at] = symbol.astype(np.float32) * step[stream]

    @staticmethod
    def _flags(parts: list[memoryview], p: np.ndarray, streams: int, per_stream: int) -> tuple[np.ndarray, np.ndarray]:
        """The ANS-coded significance flags ``[streams, per_stream]`` (uint8 0/1; 16 per symbol, escaped words
        raw) and the sign of each set one (``[streams, per_stream]`` bool, True: coarse part -1); about 4.5
        bytes per flag at their peak, whatever the payload holds."""
        padded = (per_stream + _FLAGS - 1) // _FLAGS * _FLAGS
        joint = np.empty((streams, padded // _FLAGS), dtype=np.int32)
        try:
            coder = _stream.stack.AnsCoder(np.frombuffer(parts[6], dtype="<u4").astype(np.uint32))
            for s in range(streams):
                joint[s] = coder.decode(_flag_model(float(p[s])), joint.shape[1])
            complete = coder.is_empty()
        except Exception as exc:  # constriction raises assorted errors on undecodable input
            raise CorruptBlockError(f"cachegen payload: the ANS stream does not decode: {exc}") from exc
        if not complete:
            raise CorruptBlockError("cachegen payload: the ANS stream has data left over")
        words = _TO_WORD[joint]
        escaped = joint == _ESCAPE_WORD
        del joint
        if len(parts[11]) != 2 * int(escaped.sum()):
            raise CorruptBlockError("cachegen payload: the escaped flag words have the wrong length")
        words.reshape(-1)[np.flatnonzero(escaped)] = np.frombuffer(parts[11], dtype="<u2")
        del escaped
        flags = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(streams, padded)
        del words
        if padded != per_stream:
            if flags[:, per_stream:].any():
                raise CorruptBlockError("cachegen payload: a padding flag is set")
            flags = np.ascontiguousarray(flags[:, :per_stream])
        set_count = int(np.count_nonzero(flags))
        if len(parts[8]) != (set_count + 7) // 8:
            raise CorruptBlockError("cachegen payload: the sign bits have the wrong length")
        signs = np.unpackbits(np.frombuffer(parts[8], dtype=np.uint8), count=set_count, bitorder="little")
        negative = np.zeros(flags.shape, dtype=np.bool_)
        flat_flags, flat_negative = flags.reshape(-1).view(np.bool_), negative.reshape(-1)
        done = 0
        for start in range(0, flags.size, _CHUNK):  # the set flags' indices a chunk at a time (int64: 8 bytes each)
            at = np.flatnonzero(flat_flags[start : start + _CHUNK])
            flat_negative[start : start + _CHUNK][at] = signs[done : done + len(at)]
            done += len(at)
        return flags, negative

def _subtract_where(row: np.ndarray, mask: np.ndarray, amount: np.unsignedinteger) -> None:
    """``row -= amount`` where ``mask`` (both flat, ``row`` unsigned), ``_CHUNK`` elements at a time: a product
    temporary of at most ``_CHUNK`` elements (numpy's ``where=`` is ~15x slower than a product and a subtraction)."""
    flags = mask.view(np.uint8)
    tmp = np.empty(min(_CHUNK, len(row)), dtype=row.dtype)
    for start in range(0, len(row), _CHUNK):
        end = min(start + _CHUNK, len(row))
        part = tmp[: end - start]
        np.multiply(flags[start:end], amount, out=part, casting="unsafe")
        np.subtract(row[start:end], part, out=row[start:end])


def _spread_tables() -> dict[tuple[int, int], np.ndarray]:
    """For 1-, 2- and 4-bit fields and each shift that fits a byte: the ``8 // bits`` codes of every byte,
    shifted left by ``shift``, as one little-endian word per byte, so unpacking a field is one ``np.take``."""
    tables = {}
    for bits, dtype in ((1, "<u8"), (2, "<u4"), (4, "<u2")):
        per = 8 // bits
        codes = (np.arange(256)[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
        for shift in range(8 - bits + 1):
            shifted = np.ascontiguousarray((codes << shift).astype(np.uint8))
            tables[bits, shift] = shifted.view(dtype).reshape(256)
    return tables


_SPREAD = _spread_tables()


def _pieces(width: int) -> list[tuple[int, int]]:
    """``(bits, shift)`` pieces of a ``width``-bit code: whole bytes, then a nibble, a 2-bit crumb, a bit."""
    out, shift = [], 0
    for size in (8, 4, 2, 1):
        while width - shift >= size:
            out.append((size, shift))
            shift += size
    return out


def _pack_planes(fine: np.ndarray, width: int) -> bytes:
    """The codes ``fine`` (< 2**width) in ``_pieces(width)`` fields, each packed ``8 // bits`` per byte."""
    flat = fine.reshape(-1)
    n = len(flat)
    chunks = []
    for bits, shift in _pieces(width):
        per = 8 // bits
        part = np.zeros((n + per - 1) // per * per, dtype=np.uint8)
        part[:n] = (flat >> shift) & ((1 << bits) - 1)
        grid = part.reshape(-1, per)
        packed = grid[:, 0].copy()
        for i in range(1, per):
            packed |= grid[:, i] << np.uint8(bits * i)
        chunks.append(packed.tobytes())
    return b"".join(chunks)


def _planes_len(count: int, width: int) -> int:
    return sum((count + 8 // bits - 1) // (8 // bits) for bits, _ in _pieces(width))


def _unpack_planes(buf: memoryview, count: int, width: int) -> np.ndarray:
    """Inverse of ``_pack_planes``: ``count`` codes (a new uint8 array for widths up to 8, else int32)."""
    out: np.ndarray | None = None
    pos = 0
    for bits, shift in _pieces(width):
        per = 8 // bits
        nbytes = (count + per - 1) // per
        packed = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=pos)
        pos += nbytes
        if width > 8:
            part = packed if bits == 8 else np.take(_SPREAD[bits, 0], packed).view(np.uint8)[:count]
            part = part.astype(np.int32)
            part <<= shift
        elif bits == 8:
            part = packed.copy()
        else:
            part = np.take(_SPREAD[bits, shift], packed).view(np.uint8)[:count]
        if out is None:
            out = part
        else:
            np.bitwise_or(out, part, out=out)
    assert out is not None
    return out
