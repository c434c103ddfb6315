"""Layer-by-layer forward over an assembled *layout* of cached and fresh rows (used by ``adapters.rag`` and
``adapters.prompt_modules``).

A layout is the assembled context in position order: per layer, keys and values ``[1, kv_heads, rows, head_dim]``
(RoPE applied). Some rows hold reused KV (chunks, modules, a prefix); "query rows" are computed by running their
hidden states through the model's decoder layers, each layer writing the fresh K/V of the query rows into the
layout before attending over it with an explicit additive mask (``reuse.masks``). This one mechanism gives
prefill of a suffix (TurboRAG), block-diagonal encoding (Block-Attention) and selective recompute (CacheBlend).
Positions are explicit, so layouts may have gaps (Prompt Cache parameter slots). A sliding-window layer gets its
window on top of every mask (a query at row ``r`` never sees rows ``<= r - window``, HF's sliding mask); decoding
from the assembled cache is HF ``generate``'s (``adapters.decode``). ``check_engine`` refuses, before any work, the
models the engine cannot drive exactly.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import check_supported
from kvshelf.adapters.fingerprint import kv_geometry, mla_dims
from kvshelf.kvstore.errors import UnsupportedModelError
from kvshelf.reuse.masks import causal_mask
from kvshelf.reuse.rope import rerotate_keys


@dataclass
class Layout:
    """Per-layer KV of the assembled context: ``keys[l]``, ``values[l]`` are ``[1, kv_heads, rows, head_dim]``.

    ``buffers``: for a layout made by ``empty`` with ``headroom`` and autograd off (``torch.inference_mode``,
    ``no_grad``), each layer's keys and values ``[1, kv_heads, rows + headroom, head_dim]``, of which ``keys[l]``
    / ``values[l]`` view the first ``rows`` positions: a decoding cache appends new tokens into the headroom
    without copying the layout (``adapters.decode.cache_for_decoding``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, model: PreTrainedModel, rows: int, *, zero: bool = True, headroom: int = 0) -> Layout:
        """A layout of ``rows`` rows per layer; ``zero=False`` leaves them uninitialised (cheaper: for callers that
        write every row, from blocks or by computing it); ``headroom``: that many more positions allocated past
        the rows (``buffers``; ignored with autograd on, which refuses some in-place writes into views), for the
        tokens decoding will append."""
        layers, kv_heads, head_dim = kv_geometry(model)
        k_dim = v_dim = head_dim
        mla = mla_dims(model.config)
        if mla is not None:  # transformers caches an MLA layer compressed: the latent, and the rotated shared part
            kv_heads, k_dim, v_dim = 1, mla["kv_lora_rank"], mla["qk_rope_head_dim"]
        kw = {"dtype": model.dtype, "device": model.device}
        make = torch.zeros if zero else torch.empty
        # one tensor per layer: a single one for all layers is a fresh mapping each call (page faults on every
        # write), where per-layer tensors come back from the allocator's free lists
        if not headroom or torch.is_grad_enabled():
            return cls([make((1, kv_heads, rows, k_dim), **kw) for _ in range(layers)],
                       [make((1, kv_heads, rows, v_dim), **kw) for _ in range(layers)])
        k_bufs = [make((1, kv_heads, rows + headroom, k_dim), **kw) for _ in range(layers)]
        v_bufs = [make((1, kv_heads, rows + headroom, v_dim), **kw) for _ in range(layers)]
        return cls([k[:, :, :rows] for k in k_bufs], [v[:, :, :rows] for v in v_bufs], (k_bufs, v_bufs))

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[2])

    def fill(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy a block's ``[layers, kv_heads, n, head_dim]`` keys/values into rows ``[start, start + n)``."""
        n = keys.shape[2]
        for layer in range(len(self.keys)):
            self.keys[layer][0, :, start : start + n] = keys[layer]
            self.values[layer][0, :, start : start + n] = values[layer]

    def fill_moved(self, model: PreTrainedModel, start: int, keys: torch.Tensor, values: torch.Tensor, delta: int,
                   rotaries: Sequence[hf.Rotary]) -> None:
        """``fill(start, *move_kv(model, keys, values, delta, rotaries))``: a block ``[layers, kv_heads, n,
        head_dim]`` moved ``delta`` positions into rows ``[start, start + n)``, each layer rotated straight into
        the layout (no intermediate copy of the block)."""
        n = keys.shape[2]
        moving, fixed = (values, keys) if mla_dims(model.config) is not None else (keys, values)
        moved_rows, fixed_rows = (self.values, self.keys) if moving is values else (self.keys, self.values)
        for layer, rotary in enumerate(rotaries):
            rerotate_keys(moving[layer], delta, rotary.inv_freq, interleaved=rotary.interleaved,
                          out=moved_rows[layer][0, :, start : start + n])
            fixed_rows[layer][0, :, start : start + n] = fixed[layer]

    def fill_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``[layers, kv_heads, n, head_dim]`` into the (not necessarily contiguous) layout ``rows`` ``[n]``."""
        span = contiguous_span(rows)
        if span is not None:  # a slice copy, much cheaper than a scatter
            self.fill(span.start, keys, values)
            return
        for layer in range(len(self.keys)):
            self.keys[layer][0, :, rows] = keys[layer]
            self.values[layer][0, :, rows] = values[layer]

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``rows`` as ``[layers, kv_heads, n, head_dim]`` CPU copies (a block's tensors)."""
        k = torch.stack([t[0, :, rows] for t in self.keys]).to("cpu")
        v = torch.stack([t[0, :, rows] for t in self.values]).to("cpu")
        return k, v

    def to_cache(self, model: PreTrainedModel) -> DynamicCache:
        """A ``DynamicCache`` of the model's layer types holding the layout's tensors (not copied)."""
        return hf.cache_from_tensors(list(zip(self.keys, self.values, strict=True)), model.config)


def contiguous_span(rows: torch.Tensor) -> slice | None:
    """``slice(first, last + 1)`` when ``rows`` ``[n]`` (ascending) is one contiguous run, else ``None``."""
    n = int(rows.numel())
    if n == 0:
        return None
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 != n or not bool((rows[1:] > rows[:-1]).all()):
        return None
    return slice(first, last + 1)


class _ScatterKV:
    """Duck-typed cache for one forward: a layer's fresh K/V of the query rows go into the layout at ``rows``
    and the attention sees the layout's first ``kv_end`` rows (all by default). (HF attention only calls
    ``update`` on its cache.)"""

    def __init__(self, layout: Layout, rows: torch.Tensor, kv_end: int | None = None) -> None:
        self.layout = layout
        self.rows = rows.to(layout.keys[0].device)
        self.kv_end = layout.rows if kv_end is None else kv_end
        self._slice = contiguous_span(self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layout.keys[layer_idx], self.layout.values[layer_idx]
        where = self._slice if self._slice is not None else self.rows  # a slice copy is cheaper than a scatter
        keys[:, :, where] = key_states
        values[:, :, where] = value_states
        return keys[:, :, : self.kv_end], values[:, :, : self.kv_end]


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__("captured")
        self.keys, self.values = keys, values


class _CaptureKV:
    """Duck-typed cache that stops a decoder layer right after its K/V projections (and RoPE): the layer's own
    code computes the K/V, and no attention or MLP is spent."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise _Captured(key_states, value_states)


FOLDED = "kvshelf_gqa_fold"
PARTS = "kvshelf_query_parts"  # attention kwarg: [(query slice, kv_end, tiled mask)], see ``run_layers``
# ``run_layers`` hands the query parts to ``folded_gqa_attention`` here rather than as a layer kwarg: some decoder
# layers (StableLM's) do not pass their ``**kwargs`` on to the attention, and a lost mask is a silently wrong one
_PARTS: ContextVar[list[tuple[slice, int, torch.Tensor]] | None] = ContextVar("kvshelf_query_parts", default=None)


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, h, q, d] -> [b, h_kv, g * q, d]``: the ``g`` query heads sharing a KV head, one after another."""
    batch, heads, q, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * q, dim)


def folded_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA for grouped-query attention under an explicit mask without ``repeat_kv``: the query heads that share
    a KV head are folded into the query length, ``query [b, h, q, d] -> [b, h_kv, g * q, d]``, and the mask
    ``[b, 1, q, n]`` tiled to ``[b, 1, g * q, n]`` (or passed already tiled). Same result as HF's ``sdpa``, which
    copies K/V ``g`` times whenever a mask is given. Returns ``[b, q, h, d]``.

    With ``kwargs[PARTS]`` (a list of ``(query slice, kv_end, mask [1, 1, g * q_part, kv_end])``) each run of
    queries attends only to the first ``kv_end`` keys under its own mask: causal attention of scattered query
    rows (CacheBlend) without attending to keys no query of the run can see; the layer's projections and MLP
    still run once over all queries."""
    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    parts = kwargs.pop(PARTS, None)
    if parts is None:
        parts = _PARTS.get()
    if parts is not None:
        outs = [torch.nn.functional.scaled_dot_product_attention(
                    _fold(query[:, :, part], kv_heads), key[:, :, :kv_end], value[:, :, :kv_end], attn_mask=mask,
                    dropout_p=dropout, scale=scaling).reshape(batch, heads, part.stop - part.start, value.shape[-1])
                for part, kv_end, mask in parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous(), None
    if (attention_mask is None or groups == 1 or q == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):  # no mask: HF's sdpa (causal kernel, native GQA)
        return hf.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, **kwargs)
    mask = attention_mask
    if mask is not None and mask.shape[-2] != groups * q:
        mask = mask.expand(-1, -1, q, -1).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        _fold(query, kv_heads), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None  # MLA: v's own dim


@contextmanager
def folded_attention(model: PreTrainedModel) -> Iterator[int | None]:
    """Run an ``sdpa`` model's attention as ``folded_gqa_attention`` in the block, for the calling context only
    (``hf.attention_implementation``: another thread using the model meanwhile keeps sdpa); yields the query
    heads per KV head (1 without grouped heads), or ``None`` when the model stays as it is (another attention
    implementation)."""
    config = model.config.get_text_config(decoder=True)
    groups = config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads)
    if hf.attn_implementation(model) not in ("sdpa", FOLDED):
        yield None
        return
    hf.register_attention(FOLDED, folded_gqa_attention)
    with hf.attention_implementation(model, FOLDED):  # nested: already FOLDED, left as it is
        yield groups


def refusal(model: PreTrainedModel, feature: str, reason: str) -> UnsupportedModelError:
    """The ``UnsupportedModelError`` of a model the reuse engine cannot drive: names its family (``model_type``)
    and the feature."""
    return UnsupportedModelError(f"model type {hf.model_type(model)!r}: {feature} is not supported: {reason}")


ROPE_FEATURE = "moving cached keys (RoPE re-encoding)"


def rope(model: PreTrainedModel, feature: str = ROPE_FEATURE) -> hf.Rotary:
    """The model's RoPE (inverse frequencies ``[rotary_dim / 2]``, partial rotary, interleaving) when all its
    layers share one; refusals as ``ropes``."""
    rotaries = ropes(model, feature)
    if any(r is not rotaries[0] for r in rotaries):
        raise refusal(model, feature, "its layers use different rotary tables (see ropes)")
    return rotaries[0]


def ropes(model: PreTrainedModel, feature: str = ROPE_FEATURE) -> list[hf.Rotary]:
    """Each decoder layer's RoPE (Gemma 3: local and global tables); refuses a model without one. A length-dependent
    RoPE (dynamic, longrope) is given with its original tables and the length they hold for (``check_positions``)."""
    try:
        rotaries = hf.rotaries(model)
    except UnsupportedModelError as exc:
        raise refusal(model, feature, f"no rotary position embedding the reuse engine can re-encode ({exc})") from None
    return rotaries


def check_positions(model: PreTrainedModel, rotaries: Sequence[hf.Rotary], positions: int, feature: str) -> None:
    """Refuse, before any work, a context of ``positions`` positions (new tokens included) that a length-dependent
    RoPE (``dynamic``, ``longrope``) would encode with other frequencies than its original ones: keys computed at
    one length could not be moved to, or attended at, another exactly. Up to that limit such a RoPE is static."""
    limits = [(r.static_positions, r.rope_type) for r in rotaries if r.static_positions is not None]
    if limits and positions > min(limits)[0]:
        limit, rope_type = min(limits)
        raise refusal(model, feature, f"RoPE type {rope_type!r} changes its frequencies past {limit} positions and "
                                      f"this needs {positions}; keys cannot be moved exactly")


def move_keys(keys: torch.Tensor, delta: int, rotaries: Sequence[hf.Rotary]) -> torch.Tensor:
    """A block's RoPE'd keys ``[layers, kv_heads, n, head_dim]`` moved ``delta`` positions, each layer with its own
    rotary table (``ropes``)."""
    if all(r is rotaries[0] for r in rotaries):
        return rerotate_keys(keys, delta, rotaries[0].inv_freq, interleaved=rotaries[0].interleaved)
    out = torch.empty_like(keys)
    for rotary in dict.fromkeys(rotaries):
        layers = [i for i, r in enumerate(rotaries) if r is rotary]
        out[layers] = rerotate_keys(keys[layers], delta, rotary.inv_freq, interleaved=rotary.interleaved)
    return out


def move_kv(model: PreTrainedModel, keys: torch.Tensor, values: torch.Tensor, delta: int,
            rotaries: Sequence[hf.Rotary]) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's keys and values ``[layers, kv_heads, n, head_dim]`` moved ``delta`` positions (``move_keys``). An
    MLA model's cache holds its position-free latent as keys and the rotated key part its heads share as values
    (``fingerprint.mla_dims``): those values are what moves."""
    if mla_dims(model.config) is not None:
        return keys, move_keys(values, delta, rotaries)
    return move_keys(keys, delta, rotaries), values


_VERIFIED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[str, str, str], str | None]] = (
    weakref.WeakKeyDictionary())
_VERIFIED_LOCK = threading.Lock()  # threads may check one model at once: the memo is read and written under it
PROBE_IDS = (5, 17, 29, 41, 53, 67, 79, 91)  # the self-check's prompt (ids modulo the vocabulary)


def check_engine(model: PreTrainedModel, feature: str) -> list[hf.Rotary]:
    """Refuse (``UnsupportedModelError`` naming the family and ``feature``), before any work is done or stored, a
    model whose forward the layer-by-layer engine cannot reproduce; returns its RoPE (``rope``).

    Refused: sliding-window or other non-full attention layers, decoders not in the Llama layout (no decoder
    layers with a rotary embedding: GPT-2, Falcon, Gemma 3's per-layer-type RoPE), length-dependent RoPE. Then a
    self-check, once per model, attention implementation and dtype: an 8-token prompt prefilled through the
    engine in two steps (the second against the first's KV, as a reused prefix) must give the model's own
    last-token logits. Details the engine does not know of (a multiplier, a scaled head, a layer that drops the
    mask) make it differ, and the model is refused rather than silently wrong. Returns each layer's RoPE
    (``ropes``).
    """
    try:
        check_supported(model.config, feature, sliding_window=True)  # full-attention and sliding-window layers
        hf.decoder_layers(model)
    except UnsupportedModelError as exc:
        raise refusal(model, feature, str(exc)) from None
    if mla_dims(model.config) is not None:
        try:
            hf.rotaries(model)
        except (ValueError, TypeError) as exc:  # DeepSeek-V2's rotary embedding returns complex freqs_cis
            raise refusal(model, feature, f"multi-head latent attention (MLA) whose rotary embedding gives no "
                                          f"(cos, sin) tables the engine can read ({type(exc).__name__}: {exc})"
                          ) from None
    rotaries = ropes(model, feature)
    key = (hf.attn_implementation(model), str(model.dtype), str(model.device))
    with _VERIFIED_LOCK:
        verified = _VERIFIED.setdefault(model, {})
        known = key in verified
        problem = verified.get(key)
    if not known:  # outside the lock: two threads may both check a new model (same answer), none waits on it
        problem = _self_check(model)
        with _VERIFIED_LOCK:
            _VERIFIED.setdefault(model, {})[key] = problem
    if problem is not None:
        raise refusal(model, feature, problem)
    return rotaries


@torch.inference_mode()
def _self_check(model: PreTrainedModel) -> str | None:
    """``None`` when the engine reproduces the model's own logits on a short prompt, else why not."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = [t % vocab for t in PROBE_IDS]
    want = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True,
                 past_key_values=DynamicCache(config=model.config)).logits[0, -1].float()
    layout, plain = Layout.empty(model, len(ids)), Layout.empty(model, len(ids))
    split, rows = len(ids) // 2, torch.arange(len(ids))
    try:
        prefill_rows(model, layout, ids[:split], range(split), range(split))
        got = [prefill_rows(model, layout, ids[split:], range(split, len(ids)), range(split, len(ids))),
               last_logits(model, run_layers(model, plain, embed(model, ids), rows, rows, None,  # a plain prefill
                                             range(len(hf.decoder_layers(model)))))]
    except UnsupportedModelError as exc:
        return str(exc)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        return f"its decoder layers cannot be driven one by one ({type(exc).__name__}: {exc})"
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    diff = max(float((logits - want).abs().max()) for logits in got)
    if diff > tolerance * (1.0 + float(want.abs().max())):
        return (f"its own forward does something the layer-by-layer engine does not reproduce (logits differ by "
                f"{diff:.3g} on a self-check)")
    return _rerotation_problem(model, ids, tolerance)


REROTATION_PROBE_SHIFT = 37  # the self-check moves the probe's keys by this many positions


def _rerotation_problem(model: PreTrainedModel, ids: Sequence[int], tolerance: float) -> str | None:
    """``None`` when the probe's KV computed at position 0 and moved ``REROTATION_PROBE_SHIFT`` positions
    (``move_kv``, each layer's ``ropes``) equals the KV computed there, else why not: a layer without RoPE beside
    rotated ones (Cohere 2's and EXAONE 4's full layers, Flint's sliding ones), or a rotation kvshelf does not read,
    would put moved chunks and modules at the wrong positions."""
    try:
        rotaries = hf.rotaries(model)
    except UnsupportedModelError as exc:
        return str(exc)

    def kv_at(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        hf.keep_sliding_history(cache)
        positions = torch.arange(start, start + len(ids), device=model.device)[None]
        model(input_ids=torch.tensor([list(ids)], device=model.device), position_ids=positions, use_cache=True,
              past_key_values=cache)
        tensors = hf.cache_tensors(cache)
        return torch.stack([k[0] for k, _ in tensors]).float(), torch.stack([v[0] for _, v in tensors]).float()

    try:
        (keys, values), (want_keys, want_values) = kv_at(0), kv_at(REROTATION_PROBE_SHIFT)
        moved_keys, moved_values = move_kv(model, keys, values, REROTATION_PROBE_SHIFT, rotaries)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        return f"its keys cannot be re-rotated on a self-check ({type(exc).__name__}: {exc})"
    for index in range(want_keys.shape[0]):
        diff = max(float((moved_keys[index] - want_keys[index]).abs().max()),
                   float((moved_values[index] - want_values[index]).abs().max()))
        scale = 1.0 + max(float(want_keys[index].abs().max()), float(want_values[index].abs().max()))
        if diff > tolerance * scale:
            return (f"its layer {index}'s keys computed at position 0 and re-rotated to position "
                    f"{REROTATION_PROBE_SHIFT} differ from those computed there (by {diff:.3g}: a layer without "
                    "RoPE beside rotated ones, or a rotation kvshelf does not read), so its chunks and modules "
                    "cannot be moved")
    return None


def inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """The model's RoPE inverse frequencies ``[rotary_dim / 2]``; refuses position-dependent (dynamic) RoPE."""
    check_supported(model.config)
    return rope(model).inv_freq


def embed(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """``[1, n, hidden]``: what the first decoder layer reads for ``ids`` (embedding multipliers included)."""
    return hf.input_embeddings(model, torch.tensor([list(ids)], device=model.device))


def _groups(rows: torch.Tensor, group_rows: int | None) -> list[tuple[slice, int]]:
    """Split ascending query ``rows`` ``[q]`` into runs of at most ``group_rows``; each with the layout length
    its queries can see under a causal (or block) mask: its last row + 1."""
    q = int(rows.numel())
    if not group_rows or q <= group_rows:
        return [(slice(0, q), int(rows.max()) + 1 if q else 0)]
    return [(slice(i, min(q, i + group_rows)), int(rows[min(q, i + group_rows) - 1]) + 1)
            for i in range(0, q, group_rows)]


def _group_mask(mask: torch.Tensor | None, rows: torch.Tensor, part: slice, kv_end: int, tiles: int,
                dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The ``[1, 1, tiles * q_part, kv_end]`` mask of one query group (``tiles``: folded query heads per KV head);
    with a sliding ``window``, a query at layout row ``r`` also never sees rows ``<= r - window`` (HF's sliding
    mask, ``kv_idx > q_idx - window``)."""
    q_rows = rows[part].repeat(tiles)
    out = causal_mask(q_rows, kv_end, dtype) if mask is None else mask[..., part, :kv_end].repeat(1, 1, tiles, 1)
    if window is not None:
        far = torch.arange(kv_end)[None, :] <= q_rows[:, None] - window  # [tiles * q_part, kv_end]
        out = out.masked_fill(far.to(out.device), torch.finfo(out.dtype).min)
    return out


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per decoder layer, its sliding window (``None``: full attention), as the model's cache and masks see it."""
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    return [window if kind == hf.SLIDING_ATTENTION else None for kind in hf.attention_layer_types(model.config)]


def run_layers(
    model: PreTrainedModel, layout: Layout, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
    mask: torch.Tensor | None, layers: range, *, group_rows: int | None = None,
) -> torch.Tensor:
    """Run ``hidden`` ``[1, q, hidden]`` (tokens at ``positions`` ``[q]``, layout ``rows`` ``[q]``) through
    ``layers`` under ``mask`` ``[1, 1, q, layout.rows]`` (``None``: causal over the layout, each group's mask built
    for that group only); the layout receives their K/V. Returns the hidden states.

    ``group_rows``: with ascending ``rows`` and a mask that never shows a row a later one (``causal_mask``,
    ``block_mask``), queries go through each layer in groups of that many, each attending only to the layout
    rows up to its last query: causal attention at about half the cost of attending to the whole layout (what
    CacheBlend's scattered recomputed tokens need). Results are the same up to float rounding.
    """
    position_ids = positions.to(model.device)[None]
    kinds = hf.rope_layer_types(model)  # each layer's rotary table (Gemma 3: local or global)
    tables = {kind: hf.position_embeddings(model, hidden, position_ids, kind) for kind in {kinds[i] for i in layers}}
    everything = slice(0, int(rows.numel()))
    plain_prefill = mask is None and contiguous_span(rows) == slice(0, layout.rows)
    groups = _groups(rows, group_rows) if group_rows and not plain_prefill else [(everything, layout.rows)]
    windows = layer_windows(model)  # sliding-window layers get their window on top of the mask
    with folded_attention(model) as heads_per_kv:
        if heads_per_kv is not None:  # one pass per layer; the runs of queries are split inside the attention
            cache = _ScatterKV(layout, rows, max(kv_end for _, kv_end in groups))
            parts: dict[int | None, Any] = {}
            for window in {windows[index] for index in layers}:
                # a plain prefill of every row of a full-attention layer needs no mask (SDPA's own causal kernel)
                parts[window] = None if plain_prefill and window is None else [
                    (part, kv_end, _group_mask(mask, rows, part, kv_end, heads_per_kv, model.dtype, window).to(
                        model.device)) for part, kv_end in groups]
            for index in layers:
                token = _PARTS.set(parts[windows[index]])
                try:
                    hidden = hf.run_decoder_layer(model, index, hidden, position_ids=position_ids,
                                                  embeddings=tables[kinds[index]], cache=cache, attention_mask=None)
                finally:
                    _PARTS.reset(token)
            return hidden
        # another attention implementation: each run of queries through the layer on its own, always under an
        # explicit mask (eager attention has no implicit causal mask, even for a plain prefill)
        caches = [(part, _ScatterKV(layout, rows[part], kv_end)) for part, kv_end in groups]
        masks = {window: [_group_mask(mask, rows, part, kv_end, 1, model.dtype, window).to(model.device)
                          for part, kv_end in groups] for window in {windows[index] for index in layers}}
        for index in layers:
            table = tables[kinds[index]]  # (cos, sin), or one complex tensor (DeepSeek-V2's freqs_cis)
            outs = [hf.run_decoder_layer(model, index, hidden[:, part], position_ids=position_ids[:, part],
                                         embeddings=table[:, part] if isinstance(table, torch.Tensor)
                                         else (table[0][:, part], table[1][:, part]), cache=cache,
                                         attention_mask=part_mask)
                    for (part, cache), part_mask in zip(caches, masks[windows[index]], strict=True)]
            hidden = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return hidden


def layer_kv(model: PreTrainedModel, layer: int, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V that decoder layer ``layer`` makes from its input ``hidden`` ``[1, q, hidden]`` at ``positions``
    ``[q]``: ``[1, kv_heads, q, head_dim]`` each (RoPE applied), without the layer's attention or MLP.

    CacheBlend (Yao et al., EuroSys 2025) measures KV deviation at an early layer; only the K/V projections of
    that layer are needed for every token, not its attention.
    """
    position_ids = positions.to(model.device)[None]
    embeddings = hf.position_embeddings(model, hidden, position_ids, hf.rope_layer_types(model)[layer])
    try:
        hf.run_decoder_layer(model, layer, hidden, position_ids=position_ids, embeddings=embeddings,
                             cache=_CaptureKV(), attention_mask=None)
    except _Captured as captured:
        return captured.keys, captured.values
    raise UnsupportedModelError(f"decoder layer {layer} of model type {hf.model_type(model)!r} never called its "
                                "cache's update, so the engine cannot capture its keys and values")


def write_kv(layout: Layout, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``[1, kv_heads, n, head_dim]`` K/V of one layer into layout ``rows`` ``[n]``."""
    where: slice | torch.Tensor = contiguous_span(rows) or rows
    layout.keys[layer][:, :, where] = keys
    layout.values[layer][:, :, where] = values


def last_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (float32) from the last row of ``hidden`` ``[1, q, hidden]``."""
    normed = hf.final_norm(model, hidden[:, -1:])
    return hf.lm_logits(model, normed)[0, -1].float()  # the head's own scaling (Granite, Cohere) included


def prefill_rows(
    model: PreTrainedModel, layout: Layout, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int],
    *, mask: torch.Tensor | None = None, column_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute query rows through all layers (causal over the layout unless ``mask`` is given); last logits.

    At the last layer only the last row needs attention and MLP (its logits); the other rows need only their K/V
    there, so they get the K/V projections alone."""
    rows_t, positions_t = torch.tensor(list(rows), dtype=torch.long), torch.tensor(list(positions))
    if mask is None:
        mask = causal_mask(rows_t, layout.rows, model.dtype, column_bias)
    last = len(hf.decoder_layers(model)) - 1
    with folded_attention(model):  # once for both passes (each run_layers would switch the attention itself)
        hidden = run_layers(model, layout, embed(model, ids), positions_t, rows_t, mask, range(last))
        if len(rows_t) > 1:
            k, v = layer_kv(model, last, hidden[:, :-1], positions_t[:-1])
            write_kv(layout, last, rows_t[:-1], k, v)
        hidden = run_layers(model, layout, hidden[:, -1:], positions_t[-1:], rows_t[-1:], mask[..., -1:, :],
                            range(last, last + 1))
    return last_logits(model, hidden)
