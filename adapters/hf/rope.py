"""Rotary embeddings: a model's RoPE tables (``inv_freq``, ``attention_scaling``, ``rope_type``), one per layer
type where the model has several, their convention (halves or interleaved pairs) and the ``(cos, sin)`` the decoder
layers take.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvshelf.adapters.hf.decoding import decoder, decoder_layers, model_type
from kvshelf.adapters.hf.dynamic import HFModule
from kvshelf.adapters.hf.modules import self_attention_modules
from kvshelf.adapters.hf.queries import _interleaved_rotation
from kvshelf.kvstore.errors import UnsupportedModelError


@dataclass(frozen=True, eq=False)
class Rotary:
    """A model's rotary embedding: ``inv_freq`` ``[rotary_dim / 2]`` float32 on the CPU (after any static
    scaling), ``attention_scaling`` (the factor HF multiplies cos and sin by), ``rope_type``, and its convention:
    ``rotary_dim`` (``2 * len(inv_freq)``; less than the head dim with partial rotary) and ``interleaved`` (pairs
    ``(2i, 2i + 1)``, Cohere's, rather than halves ``(i, i + rotary_dim / 2)``)."""

    inv_freq: torch.Tensor
    attention_scaling: float
    rope_type: str
    rotary_dim: int = 0
    interleaved: bool = False
    static_positions: int | None = None  # length-dependent RoPE: its tables stay ``inv_freq`` up to this many positions


def rotary(model: PreTrainedModel, layer_type: str | None = None) -> Rotary:
    """The decoder's rotary embedding parameters; ``UnsupportedModelError`` without one.

    A rotary embedding with one table per attention layer type (Gemma 3's ``full_attention_inv_freq`` and
    ``sliding_attention_inv_freq``) is read for ``layer_type``, by default the model's one layer type (refused when
    its layers have several: see ``rotaries``)."""
    rotary_emb = getattr(decoder(model), "rotary_emb", None)
    layer_type = _rope_layer_type(model, rotary_emb, layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary_emb, f"{prefix}inv_freq", None)
    if inv_freq is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no rotary embedding with inv_freq (not a RoPE "
                                    "decoder in the Llama layout)")
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    static = _static_positions(model, rotary_emb, str(rope_type), layer_type)
    if static is not None:  # the tables it starts from (and returns to on short inputs), not the current ones
        inv_freq = getattr(rotary_emb, f"{prefix}original_inv_freq", None)
        if inv_freq is None:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: RoPE type {rope_type!r} without its "
                                        "original inv_freq")
    freqs = inv_freq.detach().to("cpu", torch.float32)
    interleaved = _interleaved(model, rotary_emb, freqs.numel(), layer_type) or _applies_interleaved(model)
    return Rotary(freqs, float(getattr(rotary_emb, f"{prefix}attention_scaling", 1.0)), str(rope_type),
                  2 * freqs.numel(), interleaved, static)


def _applies_interleaved(model: PreTrainedModel) -> bool:
    """Whether the attention rotates interleaved pairs although its rotary table is in halves: GLM, GLM-4,
    ERNIE 4.5 and Helium give ``apply_rotary_pos_emb`` Llama's table and turn it into pairs there
    (``cos[..., :d // 2].repeat_interleave(2)`` with an interleaved ``rotate_half``): the rotation is Cohere's,
    pairs ``(2i, 2i + 1)`` at frequency ``i``. Read from the modeling module's ``rotate_half``."""
    try:
        modules = self_attention_modules(model)
        return bool(modules) and _interleaved_rotation(type(modules[0]))
    except UnsupportedModelError:
        return False


def _static_positions(model: PreTrainedModel, rotary_emb: HFModule, rope_type: str,
                      layer_type: str | None) -> int | None:
    """For a length-dependent RoPE (HF's ``dynamic_rope_update``), the number of positions up to which every
    forward uses its original tables: ``dynamic`` grows its frequencies past ``original_max_seq_len`` (and resets
    them below it: one less, to be safe), ``longrope`` switches to its long factors past
    ``original_max_position_embeddings``. ``None`` for static RoPE."""
    if "dynamic" in rope_type:
        return int(rotary_emb.original_max_seq_len) - 1
    if rope_type == "longrope":
        params = model.config.get_text_config(decoder=True).rope_parameters
        params = params.get(layer_type, params) if layer_type is not None else params
        return int(params["original_max_position_embeddings"])
    return None


def rope_layer_types(model: PreTrainedModel) -> list[str | None]:
    """Per decoder layer, the layer type its rotary table belongs to: ``None`` for every layer of a model with one
    rotary table, else ``config.layer_types`` (Gemma 3: local RoPE on sliding layers, global on full ones)."""
    rotary_emb = getattr(decoder(model), "rotary_emb", None)
    layers = len(decoder_layers(model))
    if not _per_layer_type(rotary_emb):
        return [None] * layers
    return list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [None] * layers)


def rotaries(model: PreTrainedModel) -> list[Rotary]:
    """``rotary`` of each decoder layer (the same object for layers of the same rotary table)."""
    kinds = rope_layer_types(model)
    tables = {kind: rotary(model, kind) for kind in dict.fromkeys(kinds)}
    return [tables[kind] for kind in kinds]


def _per_layer_type(rotary_emb: HFModule | None) -> bool:
    return rotary_emb is not None and "layer_type" in inspect.signature(rotary_emb.forward).parameters


def _rope_layer_type(model: PreTrainedModel, rotary_emb: HFModule | None, layer_type: str | None) -> str | None:
    """``None`` for a rotary embedding with one table; for one with a table per layer type (its ``forward`` takes
    ``layer_type``), ``layer_type`` or else the model's only layer type (``UnsupportedModelError`` when several)."""
    if not _per_layer_type(rotary_emb):
        return None
    if layer_type is not None:
        return layer_type
    types = sorted(set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []))
    if len(types) != 1:
        raise UnsupportedModelError(f"model type {model_type(model)!r}: one rotary embedding per layer type "
                                    f"({types}); name the layer type")
    return types[0]


def _rope_call(model: PreTrainedModel, rotary_emb: HFModule, hidden: torch.Tensor, position_ids: torch.Tensor,
               layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    layer_type = _rope_layer_type(model, rotary_emb, layer_type)
    if layer_type is None:
        return rotary_emb(hidden, position_ids=position_ids)
    return rotary_emb(hidden, position_ids=position_ids, layer_type=layer_type)


def _interleaved(model: PreTrainedModel, rotary_emb: HFModule, pairs: int, layer_type: str | None = None) -> bool:
    """Whether the rotary embedding's ``cos`` table repeats each angle twice in a row (pairs ``(2i, 2i + 1)``,
    Cohere's ``repeat_interleave``) rather than concatenating two halves (Llama's ``rotate_half``); read from
    its own output at position 1 (angles ``inv_freq``, all different)."""
    probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=model.device)
    with torch.no_grad():
        table = _rope_call(model, rotary_emb, probe, torch.ones(1, 1, dtype=torch.long, device=model.device),
                           layer_type)
    if isinstance(table, torch.Tensor) and table.is_complex():  # DeepSeek-V2's freqs_cis: pairs (2i, 2i + 1)
        if table.numel() != pairs:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: a complex rotary table of "
                                        f"{table.numel()} entries for {pairs} frequencies (an unknown RoPE layout)")
        return True
    cos = table[0].reshape(-1).float().cpu()
    if cos.numel() != 2 * pairs or pairs == 1 or torch.equal(cos[:pairs], cos[pairs:]):
        if cos.numel() != 2 * pairs:
            raise UnsupportedModelError(f"model type {model_type(model)!r}: a rotary table of {cos.numel()} "
                                        f"entries for {pairs} frequencies (an unknown RoPE layout)")
        return False
    if torch.equal(cos[0::2], cos[1::2]):
        return True
    raise UnsupportedModelError(f"model type {model_type(model)!r}: its rotary table is neither halves nor "
                                "interleaved pairs (an unknown RoPE layout)")


def position_embeddings(model: PreTrainedModel, hidden: torch.Tensor, position_ids: torch.Tensor,
                        layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``(cos, sin)`` for ``position_ids`` ``[1, q]``: each ``[1, q, d]`` (both halves equal, times the
    attention scaling) in ``hidden``'s dtype, as the decoder layers take them; a rotary embedding per layer type
    gives ``layer_type``'s (``rope_layer_types``), by default the model's one layer type's."""
    return _rope_call(model, decoder(model).rotary_emb, hidden, position_ids, layer_type)
