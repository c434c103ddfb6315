"""``cachegen``: CacheGen-style entropy coding of the KV cache.

After CacheGen (Liu et al., "CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
Serving", SIGCOMM 2024):

* **Layer-dependent quantization**: uniform quantization to ``2**b`` levels between a minimum and a maximum, with
  ``b = bits + early_extra_bits`` in the first ``ceil(early_fraction * layers)`` layers (early layers matter more
  to quality) and ``b = bits`` after. As in KIVI, the ranges of keys are per channel (each ``(layer, head, dim)``
  over groups of ``key_group`` tokens) and those of values per token (each ``(layer, token)`` over all its
  channels); the ranges are stored in fp16.
* **Deltas against anchor tokens**: tokens are split into groups of ``group_size``; the first token of each group
  is its anchor. A channel is coded either directly (its symbols ``q``) or as anchors plus deltas
  ``q_t - q_anchor`` within each group, whichever has the lower empirical entropy (one flag bit per channel;
  on SmolLM2's KV most channels code better directly, smooth channels as deltas).
* **Per-(layer, channel) symbol distributions, stored compactly**: each coded stream (a direct channel, or a delta
  channel's anchors and its deltas) gets a discretised Gaussian fitted to its symbols, stored as two fp16 numbers
  ``(mean, std)`` rather than a histogram.
* **Arithmetic coding**: all streams are coded with one ANS coder of the ``constriction`` package.

Error bound (quantization only; the entropy coding is lossless), per element of a range with fp16 minimum ``z``
and step ``s``: ``|x_hat - x| <= s / 2 + 2**-11 * |min(range)|`` (plus the rounding of the output dtype).

Decoding runs the ANS decoder symbol by symbol in constriction (~20 ns per value on this CPU) plus one table per
stream, which bounds decode throughput to ~30-60 MB/s of fp16-equivalent data (below the 300 MB/s target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import constriction
import numpy as np
import torch

from compress._cast import numel
from compress.bitpack import half_bytes, half_from, pack_bits, unpack_bits
from compress.container import pack_sections, unpack_sections
from compress.raw import tensor_bytes
from compress.registry import Codec, register_codec
from kvstore.errors import CorruptBlockError

_HALF_MAX = 65504.0
_MIN_STD = 0.25
_FLOOR = 1e-5


def _entropy_bits(symbols: torch.Tensor, alphabet: int) -> torch.Tensor:
    """Empirical entropy in bits (total over each row) of ``symbols [rows, n]`` in ``[0, alphabet)``."""
    rows, n = symbols.shape
    if n == 0:
        return torch.zeros(rows)
    hist = torch.zeros(rows, alphabet).scatter_add_(1, symbols, torch.ones(rows, n))
    p = hist / n
    return -(hist * torch.log2(p.clamp_min(1e-12))).sum(dim=1)


def _zero_step(lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 minimum and step (rounded up, so the maximum stays representable) of ``levels`` levels."""
    zero = lo.half()
    step = (hi - zero.float()).clamp_min(0) / (levels - 1).float()
    scale = step.half()
    return zero, torch.where(scale.float() < step, (step * (1 + 2**-10)).half(), scale)


def _gaussian_tables(mean: torch.Tensor, std: torch.Tensor, alphabet: int) -> np.ndarray:
    """Probabilities ``[streams, alphabet]`` (float64) of a Gaussian discretised to ``0..alphabet-1``.

    Computed from the stored fp16 parameters, so encoder and decoder build identical tables.
    """
    edges = torch.arange(alphabet + 1, dtype=torch.float64) - 0.5
    mu, sd = mean.double().unsqueeze(1), std.double().clamp_min(_MIN_STD).unsqueeze(1)
    cdf = 0.5 * (1 + torch.erf((edges - mu) / (sd * math.sqrt(2.0))))
    p = (cdf[:, 1:] - cdf[:, :-1]).clamp_min(0) + _FLOOR
    p = p / p.sum(dim=1, keepdim=True)
    return p.numpy()


@register_codec
@dataclass
class CacheGenCodec(Codec):
    """CacheGen-style codec for keys and values ``[layers, kv_heads, tokens, head_dim]`` (see the module doc).

    Parameters: ``bits`` (1..7) for the later layers, ``early_extra_bits`` (0..3) more in the first
    ``early_fraction`` (0..1) of the layers, anchors every ``group_size`` tokens, key ranges over ``key_group``
    tokens.
    """

    name = "cachegen"
    bits: int = 4
    early_extra_bits: int = 1
    early_fraction: float = 0.1
    group_size: int = 16
    key_group: int = 64

    def __post_init__(self) -> None:
        for field_name, low, high in (("bits", 1, 7), ("early_extra_bits", 0, 3), ("group_size", 2, 1 << 20),
                                        ("key_group", 1, 1 << 20)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{field_name} must be an integer in [{low}, {high}], got {value!r}")
        if self.bits + self.early_extra_bits > 8:
            raise ValueError("bits + early_extra_bits must be <= 8")
        if isinstance(self.early_fraction, bool) or not isinstance(self.early_fraction, int | float) or not (
            0.0 <= self.early_fraction <= 1.0
        ):
            raise ValueError(f"early_fraction must be a number in [0, 1], got {self.early_fraction!r}")

    # -- layout -----------------------------------------------------------------------------------------

    def _levels(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Levels per channel row ``[2 * layers * heads * dim]`` (keys' channels then values')."""
        layers, heads, _, dim = shape
        early = math.ceil(self.early_fraction * layers)
        per_layer = torch.full((layers,), 1 << self.bits, dtype=torch.long)
        per_layer[:early] = 1 << (self.bits + self.early_extra_bits)
        return per_layer.repeat_interleave(heads * dim).repeat(2)

    def _anchor_order(self, tokens: int) -> tuple[torch.Tensor, int]:
        """``(order, n_anchors)``: the token order of a delta channel's stream (anchors first, then the rest)."""
        idx = torch.arange(tokens)
        is_anchor = idx % self.group_size == 0
        return torch.cat([idx[is_anchor], idx[~is_anchor]]), int(is_anchor.sum())

    def _grid_params(
        self, x: torch.Tensor, shape: tuple[int, int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp16 ``(key_zero [L*H*D, key groups], key_step, value_zero [L, T], value_step)`` of rows ``x``."""
        layers, heads, tokens, dim = shape
        channels = layers * heads * dim
        levels = self._levels(shape)
        groups = (tokens + self.key_group - 1) // self.key_group
        pad = groups * self.key_group - tokens
        xk = x[:channels]
        xk = torch.cat([xk, xk[:, -1:].expand(channels, pad)], dim=1) if pad else xk
        xk = xk.reshape(channels, groups, self.key_group)
        xv = x[channels:].view(layers, heads * dim, tokens)
        k_zero, k_scale = _zero_step(xk.amin(2), xk.amax(2), levels[:channels, None])
        v_zero, v_scale = _zero_step(xv.amin(1), xv.amax(1), levels[channels:].view(layers, -1)[:, :1])
        return k_zero, k_scale, v_zero, v_scale

    def _expand_grid(
        self, k_zero: torch.Tensor, k_scale: torch.Tensor, v_zero: torch.Tensor, v_scale: torch.Tensor,
        shape: tuple[int, int, int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-element float32 ``(zero, step)`` ``[2 * L * H * D, T]`` from the stored fp16 grids."""
        layers, heads, tokens, dim = shape
        out = []
        for k, v in ((k_zero, v_zero), (k_scale, v_scale)):
            kf = k.float().repeat_interleave(self.key_group, dim=1)[:, :tokens]
            vf = v.float()[:, None, :].expand(layers, heads * dim, tokens).reshape(-1, tokens)
            out.append(torch.cat([kf, vf]))
        return out[0], out[1]

    @staticmethod
    def _rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        layers, heads, tokens, dim = keys.shape
        both = torch.stack([keys, values]).float().clamp(-_HALF_MAX, _HALF_MAX)  # [2, L, H, T, D]
        return both.permute(0, 1, 2, 4, 3).reshape(2 * layers * heads * dim, tokens)

    # -- encode -----------------------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes | memoryview]:
        shape = tuple(keys.shape)
        x = self._rows(keys.detach().cpu(), values.detach().cpu())
        rows, tokens = x.shape
        if x.numel() == 0:
            return pack_sections([b""] * 8)
        levels = self._levels(shape)  # type: ignore[arg-type]
        top = (levels - 1).float()
        k_zero, k_scale, v_zero, v_scale = self._grid_params(x, shape)  # type: ignore[arg-type]
        z, step = self._expand_grid(k_zero, k_scale, v_zero, v_scale, shape)  # type: ignore[arg-type]
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        q = torch.minimum(((x - z) * inv).round_().clamp_(min=0), top[:, None]).long()

        order, n_anchor = self._anchor_order(tokens)
        lv = (levels - 1)[:, None]
        anchor_pos = order[n_anchor:] // self.group_size  # stream position of each non-anchor token's anchor
        anchors = q[:, order[:n_anchor]]
        deltas = q[:, order[n_anchor:]] - anchors[:, anchor_pos] + lv
        alphabet = int(levels.max())
        direct_cost = _entropy_bits(q, alphabet)
        delta_cost = _entropy_bits(anchors, alphabet) + _entropy_bits(deltas, 2 * alphabet - 1)
        use_delta = (delta_cost + 32 < direct_cost) & (tokens > n_anchor)
        symbols = torch.where(use_delta[:, None], torch.cat([anchors, deltas], dim=1), q)

        # per-stream Gaussian parameters: segment A (a whole direct row, or a delta row's anchors), segment B
        sym_f = symbols.float()
        a_len = torch.where(use_delta, n_anchor, tokens)
        a_mask = torch.arange(tokens)[None, :] < a_len[:, None]
        a_mean = (sym_f * a_mask).sum(1) / a_len
        a_std = (((sym_f - a_mean[:, None]) ** 2 * a_mask).sum(1) / a_len).sqrt()
        b_rows = sym_f[use_delta, n_anchor:]
        b_mean = b_rows.mean(dim=1) if b_rows.shape[1] else torch.zeros(b_rows.shape[0])
        b_std = (b_rows - b_mean[:, None]).pow(2).mean(dim=1).sqrt() if b_rows.shape[1] else torch.zeros(len(b_rows))
        stats_a = torch.stack([a_mean, a_std], dim=1).half()
        stats_b = torch.stack([b_mean, b_std], dim=1).half()

        table_a = _gaussian_tables(stats_a[:, 0], stats_a[:, 1], alphabet)
        table_b = _gaussian_tables(stats_b[:, 0], stats_b[:, 1], 2 * alphabet - 1)
        sym_np = symbols.to(torch.int32).numpy()
        delta_np = use_delta.numpy()
        categorical = constriction.stream.model.Categorical
        coder = constriction.stream.stack.AnsCoder()
        b_index = int(use_delta.sum())
        for row in range(rows - 1, -1, -1):  # a stack: encode in reverse, decode forward
            if delta_np[row]:
                b_index -= 1
                coder.encode_reverse(sym_np[row, n_anchor:], categorical(table_b[b_index], perfect=False))
                coder.encode_reverse(sym_np[row, :n_anchor], categorical(table_a[row], perfect=False))
            else:
                coder.encode_reverse(sym_np[row], categorical(table_a[row], perfect=False))
        words = coder.get_compressed().astype("<u4")
        return pack_sections([
            pack_bits(use_delta.to(torch.uint8), 1), half_bytes(k_zero), half_bytes(k_scale), half_bytes(v_zero),
            half_bytes(v_scale),
            tensor_bytes(stats_a), tensor_bytes(stats_b), memoryview(words.tobytes()),
        ])

    # -- decode -----------------------------------------------------------------------------------------

    def decode(
        self, payload: memoryview, shape: tuple[int, int, int, int], dtype: torch.dtype, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layers, heads, tokens, dim = shape
        parts = unpack_sections(payload, 8, self.name)
        if numel(shape) == 0:
            if any(len(p) for p in parts):
                raise CorruptBlockError("cachegen payload has data for an empty block")
            return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        rows = 2 * layers * heads * dim
        use_delta = unpack_bits(parts[0], rows, 1).bool()
        key_groups = (tokens + self.key_group - 1) // self.key_group
        k_zero = half_from(parts[1], (rows // 2, key_groups), "key minimums", self.name)
        k_scale = half_from(parts[2], (rows // 2, key_groups), "key steps", self.name)
        v_zero = half_from(parts[3], (layers, tokens), "value minimums", self.name)
        v_scale = half_from(parts[4], (layers, tokens), "value steps", self.name)
        stats_a = half_from(parts[5], (rows, 2), "stream statistics", self.name)
        n_delta = int(use_delta.sum())
        stats_b = half_from(parts[6], (n_delta, 2), "delta statistics", self.name)
        if len(parts[7]) % 4:
            raise CorruptBlockError("cachegen payload: the ANS stream is not a whole number of words")
        order, n_anchor = self._anchor_order(tokens)
        if n_delta and tokens <= n_anchor:
            raise CorruptBlockError("cachegen payload: delta channels in a block without deltas")
        levels = self._levels(shape)
        alphabet = int(levels.max())
        table_a = _gaussian_tables(stats_a[:, 0], stats_a[:, 1], alphabet)
        table_b = _gaussian_tables(stats_b[:, 0], stats_b[:, 1], 2 * alphabet - 1)
        categorical = constriction.stream.model.Categorical
        delta_np = use_delta.numpy()
        out = np.empty((rows, tokens), dtype=np.int32)
        try:
            coder = constriction.stream.stack.AnsCoder(np.frombuffer(parts[7], dtype="<u4").astype(np.uint32))
            b_index = 0
            for row in range(rows):
                if delta_np[row]:
                    out[row, :n_anchor] = coder.decode(categorical(table_a[row], perfect=False), n_anchor)
                    out[row, n_anchor:] = coder.decode(categorical(table_b[b_index], perfect=False), tokens - n_anchor)
                    b_index += 1
                else:
                    out[row] = coder.decode(categorical(table_a[row], perfect=False), tokens)
            complete = coder.is_empty()
        except Exception as exc:  # constriction raises assorted errors on undecodable input
            raise CorruptBlockError(f"cachegen payload: the ANS stream does not decode: {exc}") from exc
        if not complete:
            raise CorruptBlockError("cachegen payload: the ANS stream has data left over")
        symbols = torch.from_numpy(out).long()
        if n_delta:
            lv = (levels - 1)[:, None]
            anchors = symbols[:, :n_anchor]
            rebuilt = torch.empty_like(symbols)
            rebuilt[:, order[:n_anchor]] = anchors
            rebuilt[:, order[n_anchor:]] = symbols[:, n_anchor:] - lv + anchors[:, order[n_anchor:] // self.group_size]
            symbols = torch.where(use_delta[:, None], rebuilt, symbols)
        if bool(((symbols < 0) | (symbols >= levels[:, None])).any()):
            raise CorruptBlockError("cachegen payload: decoded symbols out of range")
        z, step = self._expand_grid(k_zero, k_scale, v_zero, v_scale, shape)
        x = torch.addcmul(z, symbols.float(), step)
        both = x.view(2, layers, heads, dim, tokens).permute(0, 1, 2, 4, 3).to(dtype)
        return both[0].contiguous(), both[1].contiguous()
