"""Recurrent state of hybrid models beside the KV blocks: capture, restore, check, size.

A hybrid model (Qwen3-Next / Qwen3.5 gated delta-net, Nemotron-H / Bamba / Granite-MoE-hybrid Mamba2, LFM2
short convolutions) keeps, for its non-attention layers, a state rather than per-token KV: transformers 5.x holds it
in the ``DynamicCache`` 's linear-attention layers (``conv_states`` / ``recurrent_states`` per state index). Blocks
hold the attention layers; the state after a block boundary's last token is a ``kvstore.snapshot`` record keyed
``keys.state_key(boundary_key)``. A prefix is only loaded with the snapshot of its last boundary
(``CachedGenerator``): never KV without its state.

``STATE_FAMILIES`` are the model types checked exact (greedy tokens identical, fp32 logits within 1e-4 of plain
``generate``: ``tests/adapters/test_hybrid_prefix.py``); other models with state layers are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from kvshelf.adapters import hf
from kvshelf.kvstore.errors import UnsupportedModelError
from kvshelf.kvstore.snapshot import StateEntry, StateSnapshot, dtype_name

#: model types whose state layers kvshelf snapshots and restores exactly (segment-wise prefill checked equal)
STATE_FAMILIES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h",
                            "lfm2", "lfm2_moe", "granitemoehybrid", "bailing_hybrid", "jamba", "kimi_linear",
                            "olmo_hybrid", "falcon_h1", "zamba", "zamba2", "zaya", "lfm3"})
#: families with state layers checked and found not exact across prefill segments, and why
_PURE_SSM = ("a state-space model without attention layers: its transformers class keeps its own cache, not the "
             "DynamicCache state layers kvshelf snapshots")
_WITH_WINDOW = ("its layers hold a state and a sliding window in one cache layer, which keeps every token only "
                "by also keeping every past conv state: not snapshotted yet")
NOT_EXACT = {
    "bamba": "prefilling it in segments (continuing from a cached Mamba2 state) differs from one prefill by up to "
             "1e-3 in fp32 logits (transformers' torch path), so a snapshot cannot be exact",
    "recurrent_gemma": "prefilling it in segments (continuing from a cached RG-LRU state) differs from one prefill by "
                       "up to 1e-2 in fp32 logits, so a snapshot cannot be exact",
    "minimax": "it keeps its linear-attention state in its own MiniMaxCache, not in the DynamicCache state layers "
               "kvshelf snapshots",
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba"), _PURE_SSM),
    **dict.fromkeys(("rwkv", "xlstm"), "a recurrent model without attention layers: its transformers class keeps its "
                                       "recurrent state in its own cache, not the DynamicCache state layers kvshelf "
                                       "snapshots"),
    **dict.fromkeys(("inkling_text", "inkling2_text"), _WITH_WINDOW),
}
#: layer types of ``hf.attention_layer_types`` that hold a state ("hybrid": a state and full-attention KV in one
#: layer, Falcon-H1 / Zamba)
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid"})
#: codecs a snapshot is read back in without loss (plus the generator's own ``snapshot_codec``)
LOSSLESS_CODECS = frozenset({"raw", "zstd"})


def model_type(config: PretrainedConfig) -> str:
    text = config.get_text_config(decoder=True)
    return str(getattr(text, "model_type", None) or getattr(config, "model_type", "?"))


def state_layer_types(config: PretrainedConfig) -> list[str]:
    """The state layer types among the model's layers (``[]`` for a model without)."""
    return sorted(set(hf.attention_layer_types(config)) & STATE_LAYER_TYPES)


def has_state_layers(config: PretrainedConfig) -> bool:
    return bool(state_layer_types(config))


def check_state_family(config: PretrainedConfig, feature: str) -> None:
    """``UnsupportedModelError`` naming the family and its state layer types unless its state layers are
    snapshotted exactly by kvshelf (``STATE_FAMILIES``)."""
    kind = model_type(config)
    if kind in NOT_EXACT:
        raise UnsupportedModelError(f"{feature} does not support model type {kind!r}: {NOT_EXACT[kind]}")
    if kind not in STATE_FAMILIES:
        raise UnsupportedModelError(
            f"{feature} does not support model type {kind!r}: its {state_layer_types(config)} layers keep a "
            "recurrent state that kvshelf has not been checked to snapshot exactly for this family")


def capture(cache: Any, tokens: int) -> StateSnapshot:
    """The state of every state layer of ``cache`` (batch 1) after ``tokens`` tokens, copied."""
    entries, tensors = [], []
    for index, layer in hf.state_layers(cache):
        for kind, state_index, tensor in hf.layer_states(layer):
            if tensor.shape[0] != 1:
                raise UnsupportedModelError(f"only batch size 1 is snapshotted, got {tensor.shape[0]}")
            entries.append(StateEntry(index, kind, state_index, tuple(tensor.shape), dtype_name(tensor.dtype)))
            tensors.append(tensor.detach().to("cpu", copy=True))
    if not entries:
        raise UnsupportedModelError("the cache holds no recurrent state to snapshot")
    return StateSnapshot(tokens, tuple(entries), tuple(tensors))


def restore(cache: Any, snapshot: StateSnapshot, *, device: torch.device | str = "cpu") -> None:
    """Put ``snapshot`` 's states into the empty state layers of ``cache`` (copies on ``device``)."""
    layers = dict(hf.state_layers(cache))
    for entry, tensor in zip(snapshot.entries, snapshot.tensors, strict=True):
        hf.set_layer_state(layers[entry.layer], entry.kind, entry.index, tensor.to(device=device, copy=True))


@dataclass(frozen=True)
class StateSizes:
    """Bytes of one state snapshot and of one KV block of ``block_size`` tokens, for a config and dtype."""

    model_type: str
    state_layers: int
    attention_layers: int
    snapshot_bytes: int
    kv_bytes_per_block: int
    block_size: int

    @property
    def ratio(self) -> float:
        """Snapshot bytes per KV block bytes."""
        return self.snapshot_bytes / self.kv_bytes_per_block if self.kv_bytes_per_block else math.inf


def state_sizes(config: PretrainedConfig, *, block_size: int = 256, dtype: torch.dtype = torch.bfloat16,
                recurrent_dtype: torch.dtype = torch.float32) -> StateSizes:
    """Bytes per snapshot and KV bytes per block of a hybrid config, from its shapes alone (no weights), as a
    model in ``dtype`` holds them: KV and conv states in ``dtype``, recurrent states in ``recurrent_dtype``
    (transformers' gated delta-net and Mamba2 paths keep them in float32 whatever the model's dtype). The stored
    record packs all in the widest of them (a conv state of a bf16 model takes 4 bytes an element there).

    Snapshot: per state layer its conv state ``[channels, kernel]`` and recurrent state: gated delta-net
    ``conv (2 * k_heads * k_dim + v_heads * v_dim) x kernel`` and ``v_heads x k_dim x v_dim``; Mamba2
    ``conv (intermediate + 2 * groups * d_state) x kernel`` and ``heads x head_dim x d_state``; LFM2 short
    conv ``hidden x L_cache``. KV per block: per attention layer ``2 x kv_heads x head_dim x block_size``."""
    text = config.get_text_config(decoder=True)
    kind = model_type(config)
    types = hf.attention_layer_types(config)
    item = torch.empty((), dtype=dtype).element_size()
    rec_item = torch.empty((), dtype=recurrent_dtype).element_size()
    g = lambda *names, default=None: next((getattr(text, n) for n in names if getattr(text, n, None) is not None),  # noqa: E731
                                          default)
    if "linear_num_value_heads" in text.to_dict() or hasattr(text, "linear_num_value_heads"):  # gated delta-net
        kh, kd = g("linear_num_key_heads"), g("linear_key_head_dim")
        vh, vd = g("linear_num_value_heads"), g("linear_value_head_dim")
        conv = (2 * kh * kd + vh * vd) * g("linear_conv_kernel_dim")
        recurrent = vh * kd * vd
    elif kind == "lfm2" or hasattr(text, "conv_L_cache"):
        conv, recurrent = text.hidden_size * g("conv_L_cache"), 0
    elif kind in ("nemotron_h", "granitemoehybrid", "bamba"):  # Mamba2
        heads = g("mamba_num_heads", "mamba_n_heads")
        head_dim = g("mamba_head_dim", "mamba_d_head")
        d_state = g("ssm_state_size", "mamba_d_state")
        groups = g("n_groups", "mamba_n_groups", default=1)
        kernel = g("conv_kernel", "mamba_d_conv")
        conv = (heads * head_dim + 2 * groups * d_state) * kernel
        recurrent = heads * head_dim * d_state
    else:
        raise UnsupportedModelError(f"state_sizes does not know the state shapes of model type {kind!r} (it knows "
                                    "gated delta-net, LFM2 short convolutions and Nemotron-H / Granite / Bamba "
                                    "Mamba2)")
    n_state = sum(t in STATE_LAYER_TYPES for t in types)
    n_attn = sum(t in (hf.FULL_ATTENTION, hf.SLIDING_ATTENTION) for t in types)
    head_dim = g("head_dim", default=None) or text.hidden_size // text.num_attention_heads
    kv_heads = g("num_key_value_heads", default=text.num_attention_heads)
    return StateSizes(kind, n_state, n_attn, n_state * (conv * item + recurrent * rec_item),
                      n_attn * 2 * kv_heads * head_dim * block_size * item, block_size)
