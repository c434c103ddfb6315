"""Layer-by-layer forward over an assembled *layout* of cached and fresh rows (used by ``adapters.rag`` and
``adapters.prompt_modules``).

A layout is the assembled context in position order: per layer, keys and values ``[1, kv_heads, rows, head_dim]``
(RoPE applied). Some rows hold reused KV (chunks, modules, a prefix); "query rows" are computed by running their
hidden states through the model's decoder layers, each layer writing the fresh K/V of the query rows into the
layout before attending over it with an explicit additive mask (``reuse.masks``). This one mechanism gives
prefill of a suffix (TurboRAG), block-diagonal encoding (Block-Attention) and selective recompute (CacheBlend).
Positions are explicit, so layouts may have gaps (Prompt Cache parameter slots).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from adapters.cache_bridge import check_supported
from adapters.fingerprint import kv_geometry
from kvstore.errors import UnsupportedModelError
from reuse.masks import causal_mask


@dataclass
class Layout:
    """Per-layer KV of the assembled context: ``keys[l]``, ``values[l]`` are ``[1, kv_heads, rows, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, model: PreTrainedModel, rows: int) -> Layout:
        layers, kv_heads, head_dim = kv_geometry(model)
        shape = (1, kv_heads, rows, head_dim)
        kw = {"dtype": model.dtype, "device": model.device}
        return cls([torch.zeros(shape, **kw) for _ in range(layers)], [torch.zeros(shape, **kw) for _ in range(layers)])

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[2])

    def fill(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy a block's ``[layers, kv_heads, n, head_dim]`` keys/values into rows ``[start, start + n)``."""
        n = keys.shape[2]
        for layer in range(len(self.keys)):
            self.keys[layer][0, :, start : start + n] = keys[layer]
            self.values[layer][0, :, start : start + n] = values[layer]

    def fill_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``[layers, kv_heads, n, head_dim]`` into the (not necessarily contiguous) layout ``rows`` ``[n]``."""
        for layer in range(len(self.keys)):
            self.keys[layer][0, :, rows] = keys[layer]
            self.values[layer][0, :, rows] = values[layer]

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``rows`` as ``[layers, kv_heads, n, head_dim]`` CPU copies (a block's tensors)."""
        k = torch.stack([t[0, :, rows] for t in self.keys]).to("cpu")
        v = torch.stack([t[0, :, rows] for t in self.values]).to("cpu")
        return k, v

    def to_cache(self, model: PreTrainedModel) -> DynamicCache:
        cache = DynamicCache(config=model.config)
        for layer, k, v in zip(cache.layers, self.keys, self.values, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache


class _ScatterKV:
    """Duck-typed cache for one forward: a layer's fresh K/V of the query rows go into the layout at ``rows``
    and the attention sees the whole layout. (HF attention only calls ``update`` on its cache.)"""

    def __init__(self, layout: Layout, rows: torch.Tensor) -> None:
        self.layout = layout
        self.rows = rows.to(layout.keys[0].device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layout.keys[layer_idx], self.layout.values[layer_idx]
        keys[:, :, self.rows] = key_states
        values[:, :, self.rows] = value_states
        return keys, values


def decoder(model: PreTrainedModel) -> Any:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers with rotary embeddings found")
    return inner


def inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """The model's RoPE inverse frequencies ``[head_dim / 2]``; refuses position-dependent (dynamic) RoPE."""
    check_supported(model.config)
    rotary = decoder(model).rotary_emb
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        raise UnsupportedModelError(f"RoPE type {rotary.rope_type!r} depends on the length; keys cannot be moved")
    return rotary.inv_freq.detach().to("cpu", torch.float32)


def embed(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """``[1, n, hidden]`` input embeddings of ``ids``."""
    return model.get_input_embeddings()(torch.tensor([list(ids)], device=model.device))


def run_layers(
    model: PreTrainedModel, layout: Layout, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
    mask: torch.Tensor, layers: range,
) -> torch.Tensor:
    """Run ``hidden`` ``[1, q, hidden]`` (tokens at ``positions`` ``[q]``, layout ``rows`` ``[q]``) through
    ``layers`` under ``mask`` ``[1, 1, q, layout.rows]``; the layout receives their K/V. Returns the hidden states."""
    inner = decoder(model)
    position_ids = positions.to(model.device)[None]
    embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    cache = _ScatterKV(layout, rows)
    mask = mask.to(model.device)
    for index in layers:
        hidden = inner.layers[index](hidden, attention_mask=mask, position_ids=position_ids,
                                     past_key_values=cache, use_cache=True, position_embeddings=embeddings)
    return hidden


def last_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (float32) from the last row of ``hidden`` ``[1, q, hidden]``."""
    normed = decoder(model).norm(hidden[:, -1:])
    return model.get_output_embeddings()(normed)[0, -1].float()


def prefill_rows(
    model: PreTrainedModel, layout: Layout, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int],
    *, mask: torch.Tensor | None = None, column_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute query rows through all layers (causal over the layout unless ``mask`` is given); last logits."""
    rows_t = torch.tensor(list(rows), dtype=torch.long)
    if mask is None:
        mask = causal_mask(rows_t, layout.rows, model.dtype, column_bias)
    hidden = run_layers(model, layout, embed(model, ids), torch.tensor(list(positions)), rows_t, mask,
                        range(len(decoder(model).layers)))
    return last_logits(model, hidden)


@dataclass
class Decoded:
    new_ids: list[int]
    first_logits: torch.Tensor  # [vocab] float32, the distribution of the first new token
    first_token_at: float
    finished_at: float
    logits: list[torch.Tensor] = field(default_factory=list)


def eos_ids(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None | str = "default") -> set[int]:
    if eos_token_id == "default":
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


@torch.inference_mode()
def greedy_decode(
    model: PreTrainedModel, cache: DynamicCache, first_logits: torch.Tensor, next_position: int,
    max_new_tokens: int, *, eos: set[int], column_bias: torch.Tensor | None = None,
) -> Decoded:
    """Greedy decoding from a filled cache: the first token is ``argmax(first_logits)``; later steps run the
    model on one token at ``next_position + i`` with an explicit (all-visible, plus ``column_bias``) mask."""
    token = int(torch.argmax(first_logits))
    out = Decoded([token], first_logits, time.perf_counter(), 0.0, [first_logits])
    position = next_position
    while len(out.new_ids) < max_new_tokens and token not in eos:
        kv_len = cache.get_seq_length() + 1
        mask = torch.zeros((1, 1, 1, kv_len), dtype=model.dtype, device=model.device)
        if column_bias is not None:
            mask[0, 0, 0, : column_bias.shape[0]] += column_bias.to(mask)
        result = model(input_ids=torch.tensor([[token]], device=model.device),
                       position_ids=torch.tensor([[position]], device=model.device),
                       attention_mask=mask, past_key_values=cache, use_cache=True)
        logits = result.logits[0, -1].float()
        out.logits.append(logits)
        token = int(torch.argmax(logits))
        out.new_ids.append(token)
        position += 1
    out.finished_at = time.perf_counter()
    return out
